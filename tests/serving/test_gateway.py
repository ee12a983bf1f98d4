"""The gateway in front of real replica processes (``tailguard serve`` with the fake engine, whose timings the test
sets, or the tiny model): routing spreads load, failures before the first token are retried elsewhere, a replica
killed mid-stream ends the stream with a clean error event, a stalled replica degrades the answer, lanes come from API
keys only, VIP is admitted while batch saturates, overload gets 429 + Retry-After, and aborted streams give their
capacity back."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tailguard.policy.tenants import KeyFile
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.server import ThreadedServer
from tests.net import free_port
from tests.serving_helpers import ADMIN, make_config, settle, wait_until


@dataclass
class Replica:
    url: str
    proc: subprocess.Popen

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@contextlib.contextmanager
def served(cmd: list[str], port: int, name: str, timeout: float = 90) -> Iterator[Replica]:
    """A server process on a free loopback port, once its ``/ready`` answers 200; stopped on the way out."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rep = Replica(f"http://127.0.0.1:{port}", proc)
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                return httpx.get(rep.url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        assert wait_until(ready, timeout=timeout, interval=0.1), f"{name} did not get ready"
        yield rep
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def replica(tmp: Path, name: str, model: str = "fake", **fake: Any) -> Iterator[Replica]:
    """A real ``tailguard serve`` process on a free loopback port."""
    port = free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"fake": fake, "slo": {"enabled": False}}))
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--model", model, "--port", str(port), "--config",
           str(cfg), "--store", str(tmp / f"{name}.sqlite3"), "--no-access-log", "--log-level", "warning"]
    if model != "fake":
        cmd += ["--threads", "1", "--max-num-seqs", "8", "--kv-cache-tokens", "2048"]
    with served(cmd, port, f"replica {name}") as rep:
        yield rep


@contextlib.contextmanager
def gateway(tmp: Path, urls: list[str], **cfg: Any) -> Iterator[ThreadedServer]:
    replica_cfg = {"max_concurrent": cfg.pop("per_replica", 64), "send_priority": cfg.pop("send_priority", False),
                   "preempts": cfg.pop("preempts", False)}
    config = make_config(tmp, upstreams=[{"url": u, **replica_cfg} for u in urls], **cfg)
    with ThreadedServer(config, engine_factory=lambda: build_backend(config)) as server:
        assert wait_until(lambda: server.state.ready, timeout=30)
        yield server


def chat(url: str, key: str | None = None, max_tokens: int = 4, stream: bool = False, client: Any = None,
         **headers: str) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": stream}
    hdrs = {**headers, **({"Authorization": f"Bearer {key}"} if key else {})}
    return (client or httpx).post(url + "/v1/chat/completions", json=body, headers=hdrs, timeout=60)


def record(server: ThreadedServer, r: httpx.Response) -> dict:
    settle(server)
    rec = server.state.store.get(r.headers["x-request-id"])
    assert rec is not None
    return rec


def metric_value(text: str, name: str) -> float:
    """The sum of a metric's samples in a /metrics text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} is not in /metrics"
    return total


def keyfile(tmp: Path) -> tuple[Path, dict[str, str]]:
    kf = KeyFile()
    keys = {"vip": kf.add_key("acme", "vip"), "batch": kf.add_key("crawler", "batch"),
            "std": kf.add_key("shop", "standard")}
    path = tmp / "keys.yaml"
    kf.save(path)
    return path, keys


def test_routing_spreads_load_and_reports_replicas(tmp_path):
    with replica(tmp_path, "a", ttft=0.02, itl=0.005) as a, replica(tmp_path, "b", ttft=0.02, itl=0.005) as b, \
            gateway(tmp_path, [a.url, b.url]) as gw:
        with httpx.Client() as c, ThreadPoolExecutor(8) as pool:
            out = list(pool.map(lambda _: chat(gw.url, client=c, max_tokens=8), range(32)))
        assert all(r.status_code == 200 for r in out), [r.text for r in out if r.status_code != 200]
        body = out[0].json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 8
        reps = [record(gw, r)["gateway"]["replica"] for r in out]
        assert {reps.count(n) for n in set(reps)} and len(set(reps)) == 2
        assert min(reps.count(n) for n in set(reps)) >= 6  # both carry a fair share
        metrics = httpx.get(gw.url + "/metrics").text
        assert "tailguard_upstream_healthy" in metrics and "tailguard_lane_in_use_sequences" in metrics
        c = httpx.post(gw.url + "/v1/completions", json={"model": "fake", "prompt": "Once", "max_tokens": 3},
                       timeout=30)
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 3
        s = chat(gw.url, stream=True, max_tokens=5)
        events = [line for line in s.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 6


def test_failure_before_first_token_is_retried_elsewhere_and_opens_the_breaker(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with replica(tmp_path, "a", ttft=0.01, itl=0.001) as a, \
            gateway(tmp_path, [dead, a.url], routing={"health_interval_s": 60, "breaker_failures": 2}) as gw:
        pool = gw.state.engine.pool
        dead_rep = next(r for r in pool.replicas if r.url == dead)
        dead_rep.healthy = True  # as if it had just died: the health check has not noticed yet
        # Power-of-two choices between two idle replicas is a coin toss: keep asking until the dead one has been
        # tried twice (40 requests leave a chance of 4e-11 that it was not).
        out = []
        while dead_rep.errors < 2 and len(out) < 40:
            out.append(chat(gw.url))
        assert all(r.status_code == 200 for r in out), [r.text for r in out]
        attempts = [record(gw, r)["gateway"]["attempts"] for r in out]
        assert 2 in attempts  # some went to the dead replica first and were retried on the live one
        assert dead_rep.breaker.state in ("open", "half_open") and dead_rep.errors >= 2


def test_the_record_splits_the_ttft_between_the_gateway_and_the_replica(tmp_path):
    """gateway.upstream_sent: arrival to the upstream request leaving; gateway.upstream_ttft: from then to the first
    token read back. A replica scripted to 0.3 s TTFT shows in the second, the gateway's own time in the first."""
    with replica(tmp_path, "a", ttft=0.3, itl=0.001) as a, gateway(tmp_path, [a.url]) as gw:
        r = chat(gw.url, stream=True)
        assert r.status_code == 200
        rec = record(gw, r)
        g = rec["gateway"]
        assert 0 <= g["upstream_sent"] < 0.25 and 0.3 <= g["upstream_ttft"] < 2.0
        assert g["upstream_sent"] + g["upstream_ttft"] <= rec["ttft"] + 1e-5


def test_replica_killed_mid_stream_gives_a_clean_error_event(tmp_path):
    with replica(tmp_path, "a", ttft=0.01, itl=0.05) as a, gateway(tmp_path, [a.url]) as gw:
        with httpx.Client(timeout=30) as c, c.stream(
                "POST", gw.url + "/v1/chat/completions",
                json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                      "stream": True}) as resp:
            assert resp.status_code == 200
            lines = []
            for line in resp.iter_lines():
                lines.append(line)
                if sum(1 for x in lines if x.startswith("data: {")) == 3:
                    a.kill()
            data = [x for x in lines if x.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        err = json.loads(data[-2][6:])["error"]
        assert err["code"] in ("upstream_unreachable", "upstream_error") and "request id" in err["message"]
        rec = record(gw, resp)
        assert rec["status"] == 502 and rec["outcome"] == "error"
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "tailguard_stream_interrupted_requests_total") == 1.0
        assert metric_value(metrics, "tailguard_streams_started_total") == 1.0  # the rate's denominator
        assert rec["interrupted"] is True  # the record says so, and the SLO monitor's window counts it
        mon = gw.state.slo
        if mon is not None:
            view = mon.evaluate().to_dict()
            scope = next(iter(view["scopes"].values()))
            assert scope["streams"] == 1 and scope["interrupted"] == 1 and scope["interruption_rate"] == 1.0
            metrics = httpx.get(gw.url + "/metrics").text
            assert metric_value(metrics, "tailguard_slo_window_stream_interruption_ratio") == 1.0
        before = chat(gw.url, stream=True)  # the replica is gone: this one fails before its first token
        assert before.status_code == 502 and "interrupted" not in record(gw, before)


def test_stalled_replica_degrades_after_three_misses(tmp_path):
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 1.0}}
    with replica(tmp_path, "slow", ttft=0.01, itl=1.0) as a, gateway(tmp_path, [a.url], lanes=lanes) as gw:
        t0 = time.perf_counter()
        r = chat(gw.url, max_tokens=20, stream=True)
        took = time.perf_counter() - t0
        assert r.status_code == 200 and took < 3.0  # not 20 s: the stream was cut after 3 missed deadlines
        assert "service is overloaded" in r.text and r.text.rstrip().endswith("data: [DONE]")
        last = json.loads([x for x in r.text.splitlines() if x.startswith("data: {")][-1][6:])
        assert last["system_fingerprint"] == "tailguard-degraded:stall"
        rec = record(gw, r)
        assert rec["degraded"] is True and rec["slo_action"]["mode"] == "stall"
        assert rec["gateway"]["itl_misses"] == 3
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "tailguard_stream_degraded_requests_total") == 1.0
        assert metric_value(metrics, "tailguard_stream_stall_misses_total") == 3.0


def test_lanes_come_from_keys_and_a_header_cannot_claim_vip(tmp_path):
    path, keys = keyfile(tmp_path)
    with replica(tmp_path, "a", ttft=0.01, itl=0.001) as a, gateway(tmp_path, [a.url], keys_file=str(path)) as gw:
        assert chat(gw.url).status_code == 401  # a key file means keys are required
        assert chat(gw.url, key="tg-not-a-key").status_code == 401
        r = chat(gw.url, key=keys["batch"], **{"X-Lane": "vip"})
        assert r.status_code == 200
        rec = record(gw, r)
        assert rec["lane"] == "batch"
        assert rec["gateway"] == {**rec["gateway"], "tenant": "crawler",
                                            "lane_header_ignored": "vip"}
        assert record(gw, chat(gw.url, key=keys["vip"]))["lane"] == "vip"
        assert "tailguard_lane_header_ignored_requests_total" in httpx.get(gw.url + "/metrics").text


@pytest.mark.parametrize(("lend", "send_priority", "preempts"),
                         [(True, False, False), (None, False, False), (None, True, False), (None, True, True)])
def test_vip_admitted_while_batch_saturates_and_overload_gets_429(tmp_path, lend, send_priority, preempts):
    """``lend``: True, batch borrows the idle reserve; None (the default), it borrows only over replicas that preempt
    for a higher-priority arrival (``preempts``, as tailguard's own engine does); over others, vLLM-like replicas that
    take the priority but wait for a free slot included, it does not (they could not give it back before a borrowed
    stream ends), so batch stops at the general part."""
    path, keys = keyfile(tmp_path)
    lanes = {"vip": {"priority": 0, "reserved": True, "sheddable": False},
             "standard": {"priority": 1},
             "batch": {"priority": 2, "burst": False, "max_queue": 6, "max_queue_wait_s": 20}}
    capacity = {"max_concurrent": 10, "lend_reserve": lend}
    with replica(tmp_path, "a", ttft=0.01, itl=0.02) as a, \
            gateway(tmp_path, [a.url], keys_file=str(path), lanes=lanes, capacity=capacity,
                    send_priority=send_priority, preempts=preempts) as gw:
        lanes_state = gw.state.lanes
        held = 10 if lend or preempts else 8  # 8 general (+ 2 borrowed)
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(24) as pool:
            flood = [pool.submit(chat, gw.url, keys["batch"], 60, False, c) for _ in range(24)]
            assert wait_until(lambda: lanes_state.lanes["batch"].waiting > 0, timeout=10)
            assert lanes_state.lanes["batch"].in_use == held
            t0 = time.perf_counter()
            vip = chat(gw.url, keys["vip"], 2, False, c)
            vip_took = time.perf_counter() - t0
            results = [f.result() for f in flood]
        assert vip.status_code == 200 and vip_took < 1.0  # no wait behind 60-token batch streams (1.2 s each)
        assert record(gw, vip)["gateway"]["lane_wait"] < 0.05
        codes = [r.status_code for r in results]
        assert codes.count(200) >= 8 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        refused = next(r for r in results if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "lane_overloaded"
        settle(gw)
        assert all(s.in_use == 0 and s.waiting == 0 for s in lanes_state.lanes.values())


def test_aborted_streams_give_their_capacity_back(tmp_path):
    with replica(tmp_path, "a", ttft=0.01, itl=0.05) as a, gateway(tmp_path, [a.url]) as gw:
        lanes_state = gw.state.lanes
        for i in range(3):
            with httpx.Client(timeout=30) as c, c.stream(
                    "POST", gw.url + "/v1/chat/completions",
                    json={"model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 500,
                          "stream": True}, headers={"X-Request-ID": f"gone-{i}"}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break  # hang up after the first event
        assert wait_until(lambda: lanes_state.lanes["standard"].in_use == 0, timeout=10)
        assert wait_until(lambda: gw.state.engine.pool.replicas[0].in_flight == 0, timeout=10)
        settle(gw)
        rec = gw.state.store.get("gone-0")
        assert rec["status"] == 499 and rec["outcome"] == "aborted"
        # The replica saw its request aborted too (the gateway closed the upstream connection).
        up = httpx.get(a.url + "/metrics").text
        assert "tailguard_num_requests_running" in up and wait_until(
            lambda: 'tailguard_num_requests_running{model="fake"} 0.0' in httpx.get(a.url + "/metrics").text)
        assert httpx.get(gw.url + "/v1/requests/gone-0", headers=ADMIN).status_code == 200


def test_gateway_over_two_tiny_model_replicas(tmp_path):
    """Real engines behind the gateway: the tiny model in two ``tailguard serve`` processes."""
    with replica(tmp_path, "t1", model="tiny") as a, replica(tmp_path, "t2", model="tiny") as b, \
            gateway(tmp_path, [a.url, b.url]) as gw:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            out = list(pool.map(lambda _: httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60),
                                range(8)))
        assert all(r.status_code == 200 for r in out), [r.text for r in out]
        texts = {r.json()["choices"][0]["message"]["content"] for r in out}
        assert len(texts) == 1  # greedy: the same answer from either replica
        direct = httpx.post(a.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert direct["choices"][0]["message"]["content"] in texts
        reps = {record(gw, r)["gateway"]["replica"] for r in out}
        assert len(reps) == 2
        assert all(record(gw, r)["output_tokens"] == 8 for r in out)


def test_replicas_added_and_removed_at_run_time_and_told_to_the_scale_out_hook(tmp_path):
    with replica(tmp_path, "a", ttft=0.01, itl=0.001) as a, replica(tmp_path, "b", ttft=0.01, itl=0.001) as b, \
            gateway(tmp_path, [a.url]) as gw:
        assert httpx.get(gw.url + "/admin/upstreams").status_code == 401
        assert gw.state.lanes.capacity == 64
        r = httpx.post(gw.url + "/admin/upstreams", json={"url": b.url, "max_concurrent": 32}, headers=ADMIN)
        assert r.status_code == 201 and r.json()["healthy"] is True
        assert httpx.post(gw.url + "/admin/upstreams", json={"url": b.url}, headers=ADMIN).status_code == 409
        assert httpx.post(gw.url + "/admin/upstreams", json={"url": "ftp://x"}, headers=ADMIN).status_code == 400
        assert gw.state.lanes.capacity == 96  # the lanes' capacity follows the replica set
        listed = httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()["data"]
        assert [x["url"] for x in listed] == [a.url, b.url]
        # Both replicas take traffic. Routing is by load (power of two choices): a replica whose scraped queue read
        # non-zero on a busy host is passed over until its next read, so the requests go on until both have answered.
        seen: set[str] = set()
        for _ in range(64):
            seen.add(record(gw, chat(gw.url))["gateway"]["replica"])
            if len(seen) == 2:
                break
        assert seen == {x["name"] for x in listed}, [(r.name, r.outstanding_tokens, r.upstream_waiting, r.in_flight)
                                                     for r in gw.state.engine.pool.replicas]
        # The scale-out hook's payload carries the replica set.
        ctx = gw.state.slo.actions.context()
        assert [x["url"] for x in ctx["replicas"]] == [a.url, b.url]
        assert httpx.delete(gw.url + f"/admin/upstreams/{listed[0]['name']}", headers=ADMIN).status_code == 200
        out = [chat(gw.url) for _ in range(6)]
        assert {record(gw, x)["gateway"]["replica"] for x in out} == {listed[1]["name"]}
        assert httpx.delete(gw.url + f"/admin/upstreams/{listed[1]['name']}", headers=ADMIN).status_code == 409


def test_tenant_rate_limits_on_the_embedded_engine(tmp_path):
    from tests.serving_helpers import fake_server

    kf = KeyFile()
    slow = kf.add_key("slowpoke", "standard", requests_per_s=0.5, burst_s=4.0)  # 2 requests, then one per 2 s
    fast = kf.add_key("other", "standard")
    kf.save(tmp_path / "keys.yaml")
    with fake_server(tmp_path, keys_file=str(tmp_path / "keys.yaml")) as server:
        codes = [chat(server.url, slow).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        r = chat(server.url, slow)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(r.headers["retry-after"]) <= 2
        assert chat(server.url, fast).status_code == 200  # one tenant's limit is not another's
        rec = record(server, r)
        assert rec["status"] == 429 and rec["gateway"]["tenant"] == "slowpoke"


@contextlib.contextmanager
def scripted_upstream(stream: bytes, cut: int, pause_s: float = 0.003, bodies: list[dict] | None = None,
                      stall_after: int | None = None, stall_s: float = 0.0,
                      die_after: int | None = None) -> Iterator[str]:
    """An OpenAI-compatible upstream that answers every completion with ``stream``, written ``cut`` bytes at a time
    with a pause in between (so that the gateway's reads see events cut anywhere, and several in one read).
    ``bodies``: the request bodies it received are appended there. ``stall_after``: after that many writes, a pause
    of ``stall_s`` (a stream that stalls mid-way). ``die_after``: after that many writes the connection is dropped
    (a replica that dies mid-answer: the body never ends)."""
    import asyncio
    import threading

    from aiohttp import web

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if bodies is not None:
            bodies.append(json.loads(raw))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the gateway may hang up once it has read [DONE]
            for n, i in enumerate(range(0, len(stream), cut)):
                await resp.write(stream[i:i + cut])
                if n + 1 == die_after:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await asyncio.sleep(stall_s if n + 1 == stall_after else pause_s)
            await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    port = free_port()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _answers(url), timeout=10, interval=0.05)
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _upstream_chunk(delta: dict, finish: str | None = None, **extra: Any) -> dict:
    return {"id": "chatcmpl-upstream-7", "object": "chat.completion.chunk", "created": 1, "model": "fake",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


def test_upstream_tokens_relayed_exactly_whatever_the_reads_cut(tmp_path):
    texts = ["Hel", "lo, ", 'a "quoted"\nline', " caf\u00e9 \U0001f600", " back\\slash", "."]
    events = [_upstream_chunk({"role": "assistant", "content": ""})]
    events += [_upstream_chunk({"content": t}) for t in texts[:-1]]
    events += [_upstream_chunk({"content": texts[-1]}, "length"),
               {**_upstream_chunk({}), "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 6,
                                                               "total_tokens": 17}}]
    # Spaced and compact JSON, raw and escaped non-ASCII: upstreams differ.
    lines = [json.dumps(e, ensure_ascii=i % 2 == 0, separators=(",", ":") if i % 3 else None)
             for i, e in enumerate(events)]
    stream = "".join(f"data: {x}\n\n" for x in lines).encode() + b"data: [DONE]"
    # Cut every 5 bytes, all in one write, and a stream whose last line has no line end.
    for cut, end in ((5, b"\n\n"), (len(stream) + 2, b"\n\n"), (7, b"")):
        with scripted_upstream(stream + end, cut) as up, gateway(tmp_path, [up]) as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
                "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
                "stream_options": {"include_usage": True}})
            assert r.status_code == 200, r.text
            data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
            assert data[-1] == "[DONE]"
            chunks = [json.loads(x) for x in data[:-1]]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert content == "".join(texts)  # every token's text, byte for byte
            # The answer is the gateway's: its request id and the model name the client asked for.
            assert {c["id"] for c in chunks} == {"chatcmpl-" + r.headers["x-request-id"]}
            assert chunks[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 6, "total_tokens": 17}
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
            rec = record(gw, r)
            assert rec["output_tokens"] == 6 and rec["prompt_tokens"] == 11
            assert len(rec["token_times"]) == 6 and rec["ttft"] is not None and rec["ttft"] > 0
            full = chat(gw.url, max_tokens=6).json()
            assert full["choices"][0]["message"]["content"] == "".join(texts)
            assert full["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("send_priority", [False, True])
def test_a_clients_priority_claim_is_ignored_and_never_forwarded(tmp_path, send_priority):
    """vLLM's ``priority`` field from a client is not a way around the lanes: the gateway records the claim and sends
    the upstream its lane's priority (where the replica takes one), never the client's."""
    events = [_upstream_chunk({"role": "assistant", "content": ""}), _upstream_chunk({"content": "ok"}, "stop")]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    path, keys = keyfile(tmp_path)
    bodies: list[dict] = []
    with scripted_upstream(stream, len(stream), bodies=bodies) as up, \
            gateway(tmp_path, [up], keys_file=str(path), send_priority=send_priority) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {keys['batch']}"},
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "priority": -5})
        assert r.status_code == 200, r.text
        assert record(gw, r)["gateway"]["priority_ignored"] == -5
    batch_priority = 2  # the default lanes: vip 0, standard 1, batch 2
    assert bodies[-1].get("priority") == (batch_priority if send_priority else None)


@pytest.mark.parametrize("explicit", [None, 3])
def test_reserved_lane_pauses_other_lanes_on_the_embedded_engine(tmp_path, explicit):
    """With lanes on, the embedded engine pauses other lanes' sequences while a VIP request is in it (capacity.
    reserved_background_seqs, default 0), unless --max-background-seqs was given."""
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    kf = KeyFile()
    vip = kf.add_key("acme", "vip")
    kf.save(tmp_path / "keys.yaml")
    engine = AsyncLLMEngine.from_args(EngineArgs(model="tiny", kv_cache_tokens=1024, max_num_seqs=4,
                                                 max_num_batched_tokens=64, num_threads=1,
                                                 max_background_seqs=explicit))
    try:
        with ThreadedServer(make_config(tmp_path, model="tiny", keys_file=str(tmp_path / "keys.yaml")), engine) as s:
            r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                           headers={"Authorization": f"Bearer {vip}"}, timeout=60)
            assert r.status_code == 200  # a step has run: the policy set at start-up is applied
            cfg = engine.engine.scheduler.config
            if explicit is None:
                assert (cfg.max_background_seqs, cfg.protected_priority) == (0, 0)
            else:
                assert (cfg.max_background_seqs, cfg.protected_priority) == (3, None)
    finally:
        engine.shutdown()


def test_upstream_connections_are_reused_across_streams(tmp_path):
    """A stream read to [DONE] is read to its end too, so its connection goes back to the pool (one left unread is
    closed, which cost a new upstream connection for every request), and the spares opened ahead of need serve the
    requests after the first without a connect. The upstream is benchmarks/sse_upstream.py (an aiohttp app that, as
    vLLM's server does, ends the chunked body in a write of its own after [DONE]; tailguard's own replicas send the
    two together)."""
    import tailguard.observe.tracing  # noqa: F401 - loaded (by another server of the process): untraced requests still
    # go out ahead of their stream
    port = free_port()
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sse_upstream.py"
    cmd = [sys.executable, str(script), "--port", str(port), "--ttft", "0.005", "--itl", "0.005", "--end-delay", "0.05"]
    with served(cmd, port, "sse_upstream", timeout=30) as up, gateway(tmp_path, [up.url]) as gw:
        pool = gw.state.engine.pool.replicas[0].conns
        assert chat(gw.url, None, 4, True).status_code == 200  # the first stream opens a connection; spares follow
        deadline = time.monotonic() + 5
        while (pool.opening or len(pool.idle) < 1 + pool.spare) and time.monotonic() < deadline:
            time.sleep(0.01)
        opened = pool.opened
        for _ in range(5):
            r = chat(gw.url, None, 4, True)
            assert r.status_code == 200 and "[DONE]" in r.text
            time.sleep(0.1)  # the body's end arrives 50 ms after [DONE]: read in the background, then pooled
        assert pool.opened == opened  # five more streams, no new connection
        assert pool.sent_ahead >= 5  # each written on an idle connection before its stream was built
        assert pool.opened_on_demand <= 1  # only the first stream can have waited for a connect (the spares are
        # opened from the start)
        text = httpx.get(gw.url + "/metrics").text
        kinds = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                 for line in text.splitlines() if line.startswith("tailguard_upstream_connections_opened_total{")}
        assert kinds.get("ahead", 0) == opened - pool.opened_on_demand
        assert kinds.get("on_demand", 0) == pool.opened_on_demand


def test_a_completed_upstream_request_counts_as_ok_and_closes_the_breaker(tmp_path):
    """The attempt is settled before its last event goes up (the server may close the stream at that event): each
    answered request counts as ``ok`` in the replica's metrics, resets its consecutive-failure count, and a trial
    after the cooldown closes an open breaker."""
    with replica(tmp_path, "a", ttft=0.005, itl=0.005) as a, gateway(tmp_path, [a.url]) as gw:
        rep = gw.state.engine.pool.replicas[0]
        rep.breaker.failures = rep.breaker.limit - 1  # one failure short of opening
        for stream in (True, False, True, False):
            assert chat(gw.url, None, 4, stream).status_code == 200
        assert rep.breaker.failures == 0
        text = httpx.get(gw.url + "/metrics").text
        counts = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("tailguard_upstream_requests_total{")}
        assert counts == {"ok": 4}
        # An open breaker whose cooldown has passed lets one trial through; its success closes the breaker.
        rep.breaker.failures = rep.breaker.limit
        rep.breaker.opened_at = time.monotonic() - rep.breaker.cooldown - 1
        assert rep.breaker.state == "half_open"
        assert chat(gw.url, None, 4, True).status_code == 200
        assert rep.breaker.state == "closed"
