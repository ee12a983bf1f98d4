"""The gateway reads its engines: each upstream's own /metrics (vLLM, SGLang, llama.cpp's server, tailguard) parsed
for its running and waiting requests and its KV-cache use, read again every ``routing.engine_scrape_s`` from a live
upstream, weighed by the engine-aware picker (``routing.load: engine``) and by the queue gate, and shown in the
gateway's /metrics and /admin/upstreams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tailguard.backends.upstream.pool import (
    KV_FULL_LOAD,
    EngineGauges,
    RoutingConfig,
    UpstreamConfig,
    UpstreamPool,
    engine_gauges,
    queue_gauges,
)
from tests.net import free_port
from tests.serving_helpers import ADMIN, wait_until

FIXTURES = Path(__file__).parent / "engine_metrics"


def _text(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


# --- parsing ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fixture", "kind", "expected"), [
    # vLLM 0.32's own exposition: 4 running, 2 waiting (and waiting_by_reason, which must not count twice), 87% KV.
    ("vllm.txt", "vllm", EngineGauges(2.0, 4.0, 0.87)),
    # SGLang, two data-parallel ranks: counts add up, the KV use is the fuller rank's.
    ("sglang.txt", "sglang", EngineGauges(7.0, 21.0, 0.91)),
    ("llamacpp.txt", "llamacpp", EngineGauges(2.0, 4.0, 0.415039)),
    ("tailguard.txt", "tailguard", EngineGauges(2.0, 3.0, 0.5859375)),
])
def test_each_engines_metrics_text_gives_its_running_waiting_and_kv_use(fixture, kind, expected):
    text = _text(fixture)
    assert engine_gauges(text, kind) == expected
    assert engine_gauges(text) == expected  # an engine not told apart: every known name is looked for
    assert queue_gauges(text, kind) == (expected.waiting, expected.running)


def test_tailguards_own_gauges_are_read_as_its_server_writes_them():
    """Not a copy: the names and format ``tailguard serve`` exports today."""
    from prometheus_client import generate_latest

    from tailguard.observe.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.sample(5, 1, 1000, 970, 0, 0, 6, 64)
    assert engine_gauges(generate_latest(m.registry), "tailguard") == EngineGauges(1.0, 5.0, 0.97)


def test_names_are_matched_whole_and_odd_samples_are_skipped():
    text = (b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'  # the first line, with no newline before it
            b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0\n'
            b'vllm:num_requests_running{engine="0",model_name="a}b"} NaN\n'  # NaN: left out
            b'vllm:num_requests_running{engine="1",model_name="m"} 2\n'
            b'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25\n'  # before vLLM v1's rename
            b'# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n'
            b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5')  # the last line, with no newline after it
    assert engine_gauges(text, "vllm") == EngineGauges(3.0, 2.0, 0.5)
    assert engine_gauges(b"some_other_metric 7\n", "vllm") == EngineGauges()
    assert not EngineGauges().known
    # Running without a waiting gauge: the engine state has it, the queue gate's pair does not.
    assert engine_gauges(b"sglang:num_running_reqs 4\n") == EngineGauges(None, 4.0, None)
    assert queue_gauges(b"sglang:num_running_reqs 4\n") == (None, None)


# --- routing and admission ----------------------------------------------------------------------------------------
def _pool(n: int, load: str = "engine", **routing: Any) -> UpstreamPool:
    ups = [UpstreamConfig(url=f"http://127.0.0.1:{9000 + i}", name=f"r{i}", max_concurrent=8) for i in range(n)]
    return UpstreamPool(ups, RoutingConfig(load=load, **routing), rng=random.Random(3))


def _read(r, running: float | None, waiting: float | None, kv: float | None) -> None:
    """A replica as ``_scrape`` leaves it after a read of its /metrics."""
    r.upstream_running, r.upstream_waiting, r.reports_queue, r.kv_usage = running, waiting or 0.0, waiting is not None, kv
    r.has_metrics, r.scraped_at, r.in_flight_at_scrape = True, time.monotonic(), r.in_flight


def test_engine_aware_pick_avoids_a_full_kv_cache_and_a_long_queue():
    pool = _pool(3)
    a, b, c = pool.replicas
    _read(a, 8, 0, 0.97)  # KV cache full: vLLM would preempt
    _read(b, 8, 3, 0.40)  # a queue of 3
    _read(c, 6, 0, 0.50)  # busy, but room
    assert a.engine_load() >= KV_FULL_LOAD and b.engine_load() > c.engine_load()
    assert {pool.pick().name for _ in range(50)} == {"r2"}
    # Its load moves with what the gateway sends it between two reads: c takes five (two fill its free slots, and
    # three queue before its queue, full batch and KV use outweigh b's), then b and c take turns as each one's
    # estimate grows; a is never chosen.
    picks = []
    for _ in range(12):
        r = pool.pick()
        r.in_flight += 1
        picks.append(r.name)
    assert picks[:6] == ["r2"] * 5 + ["r1"] and "r0" not in picks and picks.count("r1") >= 4, picks
    # A replica whose engine reports nothing is weighed by the gateway's own requests there.
    fresh = _pool(2)
    x, y = fresh.replicas
    x.in_flight = 3
    assert fresh.pick().name == "r1"
    # The gauges the picker reads for a prefix-affinity replica too: one with a full KV cache gives way.
    pref = _pool(2, policy="prefix")
    key = pref.affinity_key("session-1", "")
    home = pref.pick(key)
    other = next(r for r in pref.replicas if r is not home)
    _read(home, 1, 0, 0.99)
    _read(other, 1, 0, 0.10)
    assert pref.pick(key) is other
    home.kv_usage = 0.30
    assert pref.pick(key) is home


def test_todays_routing_is_unchanged_by_the_engines_gauges():
    """``load: tokens`` (the default): the power of two choices on outstanding tokens plus the engine's waiting
    queue, as before; running requests and KV use are not weighed."""
    pool = _pool(2, load="tokens")
    a, b = pool.replicas
    assert pool.routing.load == "tokens" and RoutingConfig().load == "tokens"
    _read(a, 8, 0, 0.99)
    _read(b, 1, 0, 0.01)
    a.outstanding_tokens, b.outstanding_tokens = 10, 500
    assert {pool.pick().name for _ in range(20)} == {"r0"}
    b.upstream_waiting = 0  # tokens + 256 per waiting request, as before
    a.upstream_waiting = 2
    assert {pool.pick().name for _ in range(20)} == {"r1"}


def test_a_replica_with_a_full_kv_cache_counts_as_full_for_the_queue_gate():
    pool = _pool(2)
    a, b = pool.replicas
    _read(a, 4, 0, 0.50)
    _read(b, 4, 0, 0.50)
    assert not pool.queue_full(0)
    a.kv_usage = 0.96  # a full, b has room: the gate stays open (routing sends to b)
    assert not pool.queue_full(1)
    b.upstream_waiting = 2  # ... until b holds its share of the queue too
    assert pool.queue_full(1)
    b.upstream_waiting, b.kv_usage = 0, 0.97  # both full: only the reserved lane is admitted
    assert pool.queue_full(2)
    b.kv_usage = 0.60
    # Its free slots are none: a burst admitted but not yet sent queues beyond b's.
    a.slots = b.slots = 6
    assert b.free_slots() == 2
    assert not pool.queue_full(2, admitted=a.in_flight + b.in_flight + 2)
    assert pool.queue_full(2, admitted=a.in_flight + b.in_flight + 4)
    off = _pool(2, kv_full_ratio=None)
    for r in off.replicas:
        _read(r, 4, 0, 1.0)
    assert not off.queue_full(0)  # kv_full_ratio: null turns the rule off


# --- a live upstream ----------------------------------------------------------------------------------------------
def _vllm_text(running: float, waiting: float, kv: float) -> bytes:
    labels = '{engine="0",model_name="m"}'
    return (f"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {running}\n"
            f"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {waiting}\n"
            f"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{labels} {kv}\n").encode()


@contextlib.contextmanager
def engine_upstream(kind: str, state: dict[str, Any]) -> Iterator[str]:
    """A scripted engine on 127.0.0.1: /v1/models owned by ``kind`` (empty while ``state["loading"]``), /health, and
    /metrics and /slots as ``state`` says at each read (``metrics``: bytes, or an int status; ``slots``: a list, or
    absent for 404)."""
    from aiohttp import web

    async def models(_: web.Request) -> web.Response:
        listed = [] if state.get("loading") else [{"id": "m", "object": "model", "owned_by": kind}]
        return web.json_response({"object": "list", "data": listed})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_: web.Request) -> web.Response:
        state["reads"] = state.get("reads", 0) + 1
        m = state["metrics"]
        if isinstance(m, int):
            return web.Response(status=m, text="metrics are off")
        return web.Response(body=m, content_type="text/plain")

    async def slots(_: web.Request) -> web.Response:
        if "slots" not in state:
            return web.Response(status=404)
        return web.json_response(state["slots"])

    app = web.Application()
    for path, handler in (("/v1/models", models), ("/health", health), ("/metrics", metrics), ("/slots", slots)):
        app.router.add_get(path, handler)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port()
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_live_upstreams_gauges_reach_the_replica_within_half_a_second():
    state: dict[str, Any] = {"metrics": _vllm_text(1, 0, 0.10)}
    with engine_upstream("vllm", state) as url:
        async def main() -> list[float]:
            # Health checks far apart: what moves the replica's state is the engine read every 0.5 s.
            pool = UpstreamPool([UpstreamConfig(url=url)], RoutingConfig(health_interval_s=30, load="engine"))
            await pool.start()
            try:
                (r,) = pool.replicas
                assert r.kind == "vllm" and r.has_metrics
                assert (r.upstream_running, r.upstream_waiting, r.kv_usage) == (1, 0, 0.10)
                delays = []
                for i, (running, waiting, kv) in enumerate(((4, 0, 0.55), (4, 3, 0.97), (2, 0, 0.31), (0, 0, 0.0))):
                    await asyncio.sleep(0.05 + 0.13 * i)  # changes land anywhere between two reads
                    state["metrics"] = _vllm_text(running, waiting, kv)
                    t0 = time.monotonic()
                    while (r.upstream_running, r.upstream_waiting, r.kv_usage) != (running, waiting, kv):
                        assert time.monotonic() - t0 < 3, "the replica's state did not follow its /metrics"
                        await asyncio.sleep(0.005)
                    delays.append(time.monotonic() - t0)
                    if kv >= 0.95:
                        assert r.kv_full(pool.routing.kv_full_ratio) and pool.queue_full(2)
                return delays
            finally:
                await pool.close()

        delays = asyncio.run(main())
    # Read every 0.5 s: a change is seen within one period (on a loaded machine, a little over it).
    assert max(delays) < 1.0 and statistics.median(delays) < 0.6, delays


def test_a_replica_that_lists_no_model_yet_is_not_healthy_and_its_engine_not_guessed():
    # A server still loading (tailguard's lists no model until its engine is up) must not be judged by /v1/models
    # alone: it would be sent requests it answers 503, and its engine taken for a plain OpenAI server for good.
    state: dict[str, Any] = {"metrics": _text("vllm.txt"), "loading": True}
    with engine_upstream("vllm", state) as url:
        async def main() -> None:
            pool = UpstreamPool([UpstreamConfig(url=url)], RoutingConfig(health_interval_s=30))
            await pool.start()
            try:
                (r,) = pool.replicas
                assert not r.healthy and r.kind is None and r.model is None
                assert r.last_error == "health check: /v1/models lists no model yet"
                state["loading"] = False
                await pool.check(r)
                assert r.healthy and r.kind == "vllm" and r.model == "m"
            finally:
                await pool.close()

        asyncio.run(main())


def test_llamacpp_slots_say_how_many_it_runs_and_how_many_are_busy():
    slots = json.loads(_text("llamacpp_slots.json"))
    state: dict[str, Any] = {"metrics": _text("llamacpp.txt"), "slots": slots}
    with engine_upstream("llamacpp", state) as url:
        async def main() -> None:
            pool = UpstreamPool([UpstreamConfig(url=url)], RoutingConfig(health_interval_s=30))
            await pool.start()
            try:
                (r,) = pool.replicas
                # With --metrics: the slots' count from /slots, the rest from /metrics.
                assert r.kind == "llamacpp" and r.slots == 4 and r.slots_reported
                assert (r.upstream_running, r.upstream_waiting, r.kv_usage) == (4, 2, 0.415039)
                # Started without --metrics (501): the busy slots are read from /slots at the health checks.
                state["metrics"] = 501
                await pool.check(r)
                assert r.has_metrics is False
                await pool.check(r)
                assert r.upstream_running == 2 and r.slots == 4 and not r.reports_queue
            finally:
                await pool.close()

        asyncio.run(main())


def test_the_engine_gauges_show_in_the_gateways_metrics_and_admin_upstreams(tmp_path):
    from tailguard.serving.backend_factory import build_backend
    from tailguard.serving.server import ThreadedServer
    from tests.serving_helpers import make_config

    state: dict[str, Any] = {"metrics": _text("vllm.txt")}
    with engine_upstream("vllm", state) as url:
        config = make_config(tmp_path, upstreams=[{"url": url, "max_concurrent": 8}],
                             routing={"load": "engine", "engine_scrape_s": 0.2, "health_interval_s": 30})
        with ThreadedServer(config, engine_factory=lambda: build_backend(config)) as gw:
            assert wait_until(lambda: gw.state.ready, timeout=30)
            name = gw.state.engine.pool.replicas[0].name

            def sample(text: str, metric: str) -> float | None:
                for line in text.splitlines():
                    if line.startswith(metric + "{") and f'replica="{name}"' in line:
                        return float(line.rsplit(" ", 1)[1])
                return None

            def gauges() -> tuple:
                text = httpx.get(gw.url + "/metrics").text
                return tuple(sample(text, m) for m in ("tailguard_upstream_running_requests",
                                                       "tailguard_upstream_queue_requests",
                                                       "tailguard_upstream_kv_cache_usage_ratio"))

            assert wait_until(lambda: gauges() == (4.0, 2.0, 0.87), timeout=10, interval=0.1), gauges()
            listed = httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()["data"][0]
            assert listed["kind"] == "vllm"
            assert (listed["upstream_running"], listed["upstream_waiting"], listed["kv_cache_usage"]) == (4, 2, 0.87)
            assert listed["kv_full"] is False and 0 <= listed["metrics_age_s"] < 5
            # Waiting 2, plus running 4 of its 4 slots (learned: what it runs while it queues; not max_concurrent's
            # 8), plus 2.0 x 0.87^2.
            assert listed["slots"] == 4
            assert listed["load"] == pytest.approx(2 + 4 / 4 + 2 * 0.87 ** 2, abs=1e-3)
            # The engine fills its KV cache: seen within a read or two, in both places.
            state["metrics"] = _vllm_text(8, 5, 0.99)
            assert wait_until(lambda: gauges() == (8.0, 5.0, 0.99), timeout=10, interval=0.05), gauges()
            listed = httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()["data"][0]
            assert listed["kv_full"] is True and listed["load"] > KV_FULL_LOAD
