"""Scale-out that acts: the yellow tier's scale-out reaches a replica provider the server hands the actions (the SLO
floor never imports it), once per escalation, and back at green its scale-in; each step becomes a record. Through a
real gateway: the started replica takes traffic, drains a stream in flight on scale-in, and its process is gone;
replica-seconds are exported and listed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tailguard.backends.upstream.pool import UpstreamConfig, UpstreamPool
from tailguard.backends.upstream.provider import ProcessProvider, ProviderScaler
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.server import ThreadedServer
from tailguard.slo.actions import ActionEngine, RecordLog, SLOMetrics
from tailguard.slo.profiles import Selector
from tests.backends.test_provider import FAKE_REPLICA, alive
from tests.serving_helpers import ADMIN, make_config, settle, wait_until
from tests.slo_helpers import FakeClock, slo_config


class FakeScaler:
    """Stands in for the server's provider: notes each request and answers with one result."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.closed = False

    def submit(self, payload: dict[str, Any], done) -> None:
        self.calls.append(payload)
        if payload["action"] == "scale_out":
            done({"target": "provider", "ok": True, "replica": "scaled-1", "url": "http://127.0.0.1:1",
                  "message": "started replica scaled-1 at http://127.0.0.1:1 in 0.50 s"})
        else:
            done({"target": "provider", "ok": True, "event": "skipped", "message": "no replica stopped: min kept"})

    def close(self) -> None:
        self.closed = True


def engine(**actions: Any) -> tuple[ActionEngine, RecordLog, SLOMetrics]:
    cfg = slo_config(actions={"inline_hooks": True, **actions}).actions
    records, metrics = RecordLog(), SLOMetrics()
    return ActionEngine(cfg, {"all": Selector()}, records, metrics), records, metrics


def walk(eng: ActionEngine, tiers: list[int]) -> None:
    for i, tier in enumerate(tiers):
        eng.reconcile({"all": tier}, {"all": {"tier_value": 0.1 * tier}}, {("all", 1): "alert-1"}, 100.0 + i)


def test_the_yellow_tier_asks_the_provider_once_per_escalation_beside_the_hooks(tmp_path):
    out = tmp_path / "hook.jsonl"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"
    eng, records, metrics = engine(scale_out={"command": [sys.executable, "-c", script], "replicas_pct": 25})
    eng.scaler = scaler = FakeScaler()
    walk(eng, [1, 2, 3, 1, 0, 0, 1])
    assert [(c["action"], c["replicas_delta_pct"]) for c in scaler.calls] == [
        ("scale_out", 25.0), ("scale_in", -25.0), ("scale_out", 25.0)]
    assert scaler.calls[0]["alert_id"] == "alert-1" and scaler.calls[0]["figures"] == {"tier_value": 0.1}
    # The command hook still runs, told the same.
    assert [json.loads(x)["action"] for x in out.read_text().splitlines()] == ["scale_out", "scale_in", "scale_out"]
    acts = [r for r in records.list() if r["kind"] == "action" and r["name"] == "scale_out"]
    assert [(r["event"], r["details"]["hook"], r["details"]["provider"]) for r in acts] == [
        ("started", "submitted", "submitted"), ("undone", "submitted", "submitted"),
        ("started", "submitted", "submitted")]
    prov = [r for r in records.list() if r["kind"] == "hook" and r["details"].get("target") == "provider"]
    assert [(r["name"], r["event"]) for r in prov] == [("scale_out", "ok"), ("scale_in", "skipped"),
                                                       ("scale_out", "ok")]
    assert prov[0]["details"]["message"] == "started replica scaled-1 at http://127.0.0.1:1 in 0.50 s"
    assert prov[0]["details"]["ref"] == acts[0]["id"] and prov[0]["alert_id"] == "alert-1"
    assert metrics.hook_calls.labels("provider", "ok")._value.get() == 2
    assert metrics.hook_calls.labels("command", "ok")._value.get() == 3
    eng.close()
    assert scaler.closed


def test_dry_run_and_undo_off_leave_the_provider_alone():
    eng, records, _ = engine(dry_run=True)
    eng.scaler = scaler = FakeScaler()
    walk(eng, [1, 0])
    assert scaler.calls == []
    assert [r["details"]["provider"] for r in records.list() if r["kind"] == "action"] == ["dry_run", "dry_run"]
    eng, records, _ = engine(scale_out={"undo": False})
    eng.scaler = scaler = FakeScaler()
    walk(eng, [1, 0])
    assert [c["action"] for c in scaler.calls] == ["scale_out"]
    assert [r["details"]["provider"] for r in records.list() if r["kind"] == "action"] == ["submitted",
                                                                                           "undo_disabled"]


@contextlib.contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


def test_a_replica_that_never_gets_healthy_is_a_failed_record_and_no_process(tmp_path):
    never = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(60)", "{port}"]
    eng, records, metrics = engine(scale_out={"provider": {"command": never, "start_timeout_s": 1.0,
                                                           "stop_grace_s": 1.0, "log_dir": str(tmp_path)}})
    cfg = eng.cfg.scale_out.provider
    assert cfg is not None
    with event_loop() as loop:
        pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9", name="static")])
        provider = ProcessProvider(cfg, pool)
        eng.scaler = scaler = ProviderScaler(provider, loop)
        try:
            walk(eng, [1])
            assert scaler.flush(10)
            (rec,) = [r for r in records.list() if r["kind"] == "hook"]
            assert (rec["name"], rec["event"]) == ("scale_out", "failed")
            d = rec["details"]
            assert d["target"] == "provider" and d["replica"] == "scaled-1"
            assert d["error"].startswith("replica scaled-1 did not become healthy within 1 s")
            assert "its process was stopped" in d["error"] and "loading weights" in d["output"]
            assert Path(d["log"]).parent == tmp_path
            assert provider.replicas() == [] and provider.ended[0].pid is not None
            assert not alive(provider.ended[0].pid)
            assert metrics.hook_calls.labels("provider", "failed")._value.get() == 1
        finally:
            eng.close()  # stops whatever the provider runs


def stream(url: str, max_tokens: int) -> tuple[int, list[str], str]:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        return r.status_code, lines, r.headers["x-request-id"]


def tokens(lines: list[str]) -> int:
    text = ""
    for x in lines[:-1]:
        for c in json.loads(x[6:]).get("choices") or []:
            text += c["delta"].get("content") or ""
    return text.count("tok")


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} is not in /metrics")


@pytest.fixture
def static_replica() -> Iterator[FakeServerProcess]:
    with FakeServerProcess(FakeScript(ttft=0.01, itl=0.05, max_lifetime=120)) as srv:
        yield srv


def test_a_gateway_scales_out_through_its_provider_and_drains_on_scale_in(static_replica, tmp_path):
    clock = FakeClock()
    slo = slo_config(actions={"scale_out": {"provider": {
        "command": FAKE_REPLICA, "max_replicas": 2, "start_timeout_s": 10, "drain_timeout_s": 10,
        "stop_grace_s": 2, "log_dir": str(tmp_path / "replicas")}}})
    config = make_config(tmp_path, upstreams=[{"url": static_replica.url}], slo=slo,
                         routing={"health_interval_s": 0.5})
    with ThreadedServer(config, engine_factory=lambda: build_backend(config), slo_clock=clock) as gw:
        assert wait_until(lambda: gw.state.ready, timeout=30)
        state = gw.state
        pool, actions = state.upstream.pool, state.slo.actions
        scaler = actions.scaler
        assert isinstance(scaler, ProviderScaler) and scaler.provider is state.provider
        assert state.lanes.capacity == 64

        def tier(level: int) -> None:
            actions.reconcile({"all": level}, {"all": {"tier_value": 0.5 * level}}, {}, clock())
            clock.advance(1.0)

        tier(1)  # yellow: one replica (10% of one, rounded up)
        assert scaler.flush(20)
        (rep,) = state.provider.replicas()
        assert rep.state == "serving" and rep.pid is not None and alive(rep.pid)
        started = [r for r in state.slo.alerts(limit=None) if r["kind"] == "hook"]
        assert [(r["name"], r["event"]) for r in started] == [("scale_out", "ok")]
        assert started[0]["details"]["message"].startswith(f"started replica {rep.name} at {rep.url} in ")
        assert state.lanes.capacity == 128  # the lanes' capacity follows the replica set
        listed = httpx.get(gw.url + "/admin/upstreams", headers=ADMIN).json()
        assert [(x["source"], x["healthy"]) for x in listed["data"]] == [("static", True), ("provider", True)]
        assert listed["data"][1]["name"] == rep.name and listed["data"][1]["alive_s"] > 0
        assert listed["provider"]["replicas"][0]["state"] == "serving"
        assert listed["replica_seconds"]["provider"] > 0 and listed["replica_seconds"]["static"] > 0
        tier(2)
        tier(1)  # still the same escalation: nothing more
        assert scaler.flush(5) and len(state.provider.replicas()) == 1

        # Streams in flight on both replicas, then back to green: the started one drains, then stops.
        with ThreadPoolExecutor(4) as ex:
            futs = [ex.submit(stream, gw.url, 30) for _ in range(4)]
            at = next(r for r in pool.replicas if r.name == rep.name)
            assert wait_until(lambda: at.busy > 0, timeout=10), "no stream reached the started replica"
            tier(0)
            assert wait_until(lambda: at.draining, timeout=5)
            assert state.lanes.capacity == 64
            plain = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
                "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert plain.status_code == 200
            results = [f.result() for f in futs]
        for status, lines, _ in results:
            assert status == 200 and lines[-1] == "data: [DONE]" and tokens(lines) == 30
        assert scaler.flush(20)
        settle(gw)
        served_by = [state.store.get(rid)["gateway"]["replica"] for _, _, rid in results]
        assert rep.name in served_by  # a stream the drain let finish
        assert state.store.get(plain.headers["x-request-id"])["gateway"]["replica"] != rep.name
        stopped = [r for r in state.slo.alerts(limit=None) if r["kind"] == "hook" and r["name"] == "scale_in"]
        assert [r["event"] for r in stopped] == ["ok"]
        d = stopped[0]["details"]
        assert d["drained_requests"] >= 1 and d["cut_off_requests"] == 0 and not d["killed"]
        assert d["message"].startswith(f"stopped replica {rep.name} after draining ")
        assert not alive(rep.pid) and state.provider.replicas() == []
        assert [r.name for r in pool.replicas] != [] and rep.name not in [r.name for r in pool.replicas]

        # Replica-seconds: exported, and the stopped replica's no longer grow.
        text = httpx.get(gw.url + "/metrics").text
        prov_s = metric(text, "tailguard_gateway_replica_seconds_total", source="provider")
        assert prov_s == pytest.approx(rep.alive_s(), abs=0.05) and prov_s > 1.0
        assert metric(text, "tailguard_gateway_replica_seconds_total", source="static") > prov_s
        assert metric(text, "tailguard_gateway_replicas", source="static", state="serving") == 1
        assert metric(text, "tailguard_gateway_replicas", source="provider", state="serving") == 0
        time.sleep(0.1)
        text = httpx.get(gw.url + "/metrics").text
        assert metric(text, "tailguard_gateway_replica_seconds_total", source="provider") == prov_s

        tier(1)  # a new escalation: a new replica
        assert scaler.flush(20)
        (again,) = state.provider.replicas()
        assert again.name != rep.name and again.pid is not None and alive(again.pid)
        # Taken out through the admin API: drained and stopped, as a scale-in does.
        r = httpx.delete(gw.url + f"/admin/upstreams/{again.name}", headers=ADMIN, timeout=30)
        assert r.status_code == 200 and r.json()["stopped"]["cut_off_requests"] == 0, r.text
        assert not alive(again.pid) and again.name not in [x.name for x in pool.replicas]
        # One more, left running: the gateway's shutdown stops it.
        last = asyncio.run_coroutine_threadsafe(state.provider.start_replica(), scaler.loop).result(20)
        assert last.pid is not None and alive(last.pid)
    assert not alive(last.pid)
