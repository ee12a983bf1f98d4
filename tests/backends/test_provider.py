"""The process replica provider, with real processes: a replica started from a command template is health-checked,
joins the pool and answers there; on scale-in it drains (a streaming request in flight at it finishes), leaves the
pool and its process is gone; a command that never becomes healthy (or exits, or does not exist) fails with a clear
message and leaves nothing running; the bounds hold; replica-seconds grow with what is alive."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tailguard.backends.upstream.pool import RoutingConfig, UpstreamConfig, UpstreamPool
from tailguard.backends.upstream.provider import ProcessProvider, ReplicaLedger, ReplicaStartError, plan_scale
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.slo.config import ProcessProviderConfig, ScaleOutConfig

# A fake OpenAI-compatible replica: 50 ms between tokens, so that a 20-token stream is in flight for about a second.
FAKE_REPLICA = [sys.executable, "-m", "tailguard.bench.fakeserver", "--port", "{port}", "--ttft", "0.01", "--itl",
                "0.05", "--max-lifetime", "120"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a container's init may be slow to reap what it inherits)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def provider_config(tmp: Path, **kw: Any) -> ProcessProviderConfig:
    kw.setdefault("command", FAKE_REPLICA)
    kw.setdefault("start_timeout_s", 10)
    kw.setdefault("drain_timeout_s", 5)
    kw.setdefault("stop_grace_s", 2)
    return ProcessProviderConfig(log_dir=str(tmp / "replicas"), **kw)


@pytest.fixture
def static_replica() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeScript(ttft=0.005, itl=0.005, max_lifetime=120)) as srv:
        yield srv


def run_with_pool(url: str, body) -> Any:
    """``body(pool)`` on a fresh event loop, with a started pool over one configured replica; closed after."""
    async def main() -> Any:
        pool = UpstreamPool([UpstreamConfig(url=url, name="static")], RoutingConfig(health_interval_s=0.5))
        await pool.start()
        try:
            return await body(pool)
        finally:
            await pool.close()
    return asyncio.run(main())


async def stream_chat(pool: UpstreamPool, name: str, max_tokens: int) -> list[bytes]:
    """One streaming chat request straight on a replica's connections (as the gateway's attempt sends it)."""
    r = next(x for x in pool.replicas if x.name == name)
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                       "stream": True}).encode()
    out = b""
    async with r.conns.request("POST", "/v1/chat/completions", body,
                               {"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        while data := await resp.read():
            out += data
    return [line for line in out.split(b"\n") if line.startswith(b"data: ")]


def test_a_started_replica_serves_then_drains_a_stream_and_its_process_stops(static_replica, tmp_path):
    cfg = provider_config(tmp_path)

    async def body(pool: UpstreamPool) -> None:
        prov = ProcessProvider(cfg, pool)
        ledger = ReplicaLedger(pool, prov)
        try:
            rep = await prov.start_replica()
            assert rep.state == "serving" and rep.pid is not None and alive(rep.pid)
            assert rep.url.startswith("http://127.0.0.1:") and rep.started_in_s is not None
            assert rep.started_in_s < cfg.start_timeout_s
            r = next(x for x in pool.replicas if x.name == rep.name)
            assert r.url == rep.url and r.available and r.model == "fake"
            assert pool.pick(exclude={"static"}) is r  # it takes traffic
            assert prov.owns(rep.url) and ledger.entry(r)["source"] == "provider"
            assert ledger.entry(pool.replicas[0])["source"] == "static"

            # A stream in flight at it when the scale-in begins: it finishes, and nothing new is routed there.
            stream = asyncio.create_task(stream_chat(pool, rep.name, max_tokens=20))
            while r.busy == 0:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(prov.stop_replica())
            while not r.draining:
                await asyncio.sleep(0.01)
            assert rep.state == "draining" and not r.available
            assert all(pool.pick().name == "static" for _ in range(20))
            events = await stream
            assert events[-1] == b"data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            assert text.count("tok") == 20  # the whole answer, not cut by the drain
            report = await stopping
            assert report.drained == 1 and report.left == 0 and not report.killed
            assert rep.name not in [x.name for x in pool.replicas]
            assert rep.state == "stopped" and rep.proc is not None and rep.proc.poll() is not None
            assert not alive(rep.pid)
            # Replica-seconds: the provider's froze when its replica stopped; the configured replica's go on.
            s1 = ledger.seconds()
            assert s1["provider"] == pytest.approx(report.alive_s, abs=0.01) and s1["provider"] > 0.5
            await asyncio.sleep(0.2)
            s2 = ledger.seconds()
            assert s2["provider"] == s1["provider"] and s2["static"] >= s1["static"] + 0.15
            assert s2["total"] == pytest.approx(s2["static"] + s2["provider"])
        finally:
            prov.close_now()

    run_with_pool(static_replica.url, body)


def test_scale_steps_round_up_and_keep_within_the_bounds(static_replica, tmp_path):
    cfg = provider_config(tmp_path, max_replicas=1)

    async def body(pool: UpstreamPool) -> None:
        prov = ProcessProvider(cfg, pool)
        try:
            seen: list[dict] = []
            res = await prov.scale(10.0, seen.append)  # 10% of 1 replica: rounded up to one
            assert res == seen and len(res) == 1 and res[0]["ok"], res
            assert res[0]["message"].startswith(f"started replica scaled-1 at {res[0]['url']} in ")
            assert len(pool.replicas) == 2
            res = await prov.scale(10.0)
            assert [(x["event"], x["bound"]) for x in res] == [("skipped", "max_replicas (1) reached")]
            assert len(prov.replicas()) == 1
            res = await prov.scale(-10.0)
            assert res[0]["ok"] and res[0]["message"].startswith("stopped replica scaled-1 after draining 0 requests")
            assert [x.name for x in pool.replicas] == ["static"] and prov.replicas() == []
            res = await prov.scale(-10.0)
            assert res[0]["event"] == "skipped" and "no replica started by the provider" in res[0]["bound"]
        finally:
            prov.close_now()

    run_with_pool(static_replica.url, body)


def test_plan_scale():
    assert plan_scale(10, base=2, running=0, min_replicas=0, max_replicas=4) == (1, 1, None)
    assert plan_scale(50, base=5, running=0, min_replicas=0, max_replicas=4) == (3, 3, None)
    assert plan_scale(100, base=5, running=1, min_replicas=0, max_replicas=4) == (3, 5, "max_replicas (4) reached")
    assert plan_scale(10, base=10, running=0, min_replicas=0, max_replicas=4) == (1, 1, None)  # 10% of 10: one
    assert plan_scale(-10, base=3, running=1, min_replicas=0, max_replicas=4) == (-1, 1, None)
    assert plan_scale(-10, base=3, running=1, min_replicas=1, max_replicas=4) == (0, 1, "min_replicas (1) kept")


def test_a_replica_that_never_gets_healthy_fails_clearly_and_leaves_nothing_running(tmp_path):
    # It starts a child of its own (as a wrapper script would) and never listens.
    never = [sys.executable, "-c", "import subprocess, sys, time; "
             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print('warming up, child', c.pid, flush=True); time.sleep(60)", "{port}"]
    exits = [sys.executable, "-c", "import sys; print('unknown flag --port', sys.argv[1]); sys.exit(3)", "{port}"]

    made: list[ProcessProvider] = []

    async def body(pool: UpstreamPool) -> None:
        prov = ProcessProvider(provider_config(tmp_path, command=never, start_timeout_s=1.0), pool)
        made.append(prov)
        t0 = time.monotonic()
        with pytest.raises(ReplicaStartError) as info:
            await prov.start_replica()
        assert time.monotonic() - t0 < 5
        err = info.value
        assert "did not become healthy within 1 s" in str(err) and "its process was stopped" in str(err)
        assert "/v1/models never answered 200" in str(err)
        assert "warming up" in err.output
        rep = err.replica
        assert rep is not None and rep.state == "failed" and rep.pid is not None and not alive(rep.pid)
        child = int(err.output.split("child", 1)[1].split()[0])
        deadline = time.monotonic() + 3
        while alive(child) and time.monotonic() < deadline:  # its group got the signal too
            await asyncio.sleep(0.05)
        assert not alive(child)
        assert [x.name for x in pool.replicas] == ["static"] and prov.replicas() == []
        assert prov.failed == 1 and prov.summary()["ended"][0]["state"] == "failed"

        prov2 = ProcessProvider(provider_config(tmp_path, command=exits, name_prefix="bad"), pool)
        made.append(prov2)
        res = await prov2.scale(10.0)
        assert len(res) == 1 and not res[0]["ok"]
        assert "exited with status 3 before it became healthy" in res[0]["error"]
        assert "unknown flag --port" in res[0]["output"] and res[0]["exit_status"] == 3

        prov3 = ProcessProvider(provider_config(tmp_path, command=["/nonexistent/replica", "{port}"]), pool)
        with pytest.raises(ReplicaStartError, match="its command could not be started"):
            await prov3.start_replica()

    # The pool's one replica need not answer: nothing here reaches the pool.
    async def main() -> None:
        await body(UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9", name="static")]))
    try:
        asyncio.run(main())
    finally:
        for prov in made:
            prov.close_now()


def test_close_now_stops_every_replica(static_replica, tmp_path):
    async def body(pool: UpstreamPool) -> None:
        prov = ProcessProvider(provider_config(tmp_path, min_replicas=1), pool)
        try:
            task = prov.keep_minimum()
            assert task is not None
            await task
            (rep,) = prov.replicas()
            assert rep.state == "serving" and rep.pid is not None and alive(rep.pid)
            prov.close_now()
            assert not alive(rep.pid) and prov.replicas() == [] and prov.replica_seconds() > 0
            with pytest.raises(ReplicaStartError, match="shutting down"):
                await prov.start_replica()
        finally:
            prov.close_now()

    run_with_pool(static_replica.url, body)


def test_provider_config_is_validated():
    cfg = ScaleOutConfig.model_validate({"replicas_pct": 10, "provider": {
        "kind": "process", "command": "python -m tailguard.cli serve --model fake --port {port}",
        "min_replicas": 0, "max_replicas": 4, "start_timeout_s": 60, "drain_timeout_s": 30}})
    assert cfg.provider is not None and cfg.provider.command[-1] == "{port}" and cfg.provider.kind == "process"
    with pytest.raises(ValidationError, match=r"needs \{port\}"):
        ProcessProviderConfig(command=["vllm", "serve", "m"])
    with pytest.raises(ValidationError, match="must not exceed max_replicas"):
        ProcessProviderConfig(command=["x", "{port}"], min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError):
        ScaleOutConfig.model_validate({"provider": {"kind": "kubernetes", "command": ["x", "{port}"]}})
    with pytest.raises(ValidationError):
        ProcessProviderConfig(command=["x", "{port}"], start_timeout_s=0)


def test_a_configured_replica_the_gateway_cannot_reach_costs_no_replica_seconds(static_replica):
    async def main() -> None:
        pool = UpstreamPool([UpstreamConfig(url=static_replica.url, name="up"),
                             UpstreamConfig(url="http://127.0.0.1:9", name="down")], RoutingConfig())
        await pool.start()  # the first health check: "down" refuses connections
        try:
            ledger = ReplicaLedger(pool)
            await asyncio.sleep(0.3)
            ledger.sync()
            up, down = (ledger.entry(r) for r in pool.replicas)
            assert up["source"] == down["source"] == "static"
            assert up["alive_s"] >= 0.25 and down["alive_s"] == 0
            assert ledger.seconds()["static"] == pytest.approx(up["alive_s"], abs=0.05)
            pool.remove("up")
            ledger.sync()
            frozen = ledger.seconds()["static"]
            await asyncio.sleep(0.1)
            assert ledger.seconds()["static"] == frozen  # it left the pool: its cost stops
        finally:
            await pool.close()
    asyncio.run(main())
