"""The monitor without a server: tier hysteresis, scale hooks (webhook and command), golden-rule advisories,
hotspots, and robustness (a broken sink, a hanging webhook, a failing evaluation)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time

import numpy as np
import pytest

from tailguard.slo.config import MonitorConfig, TierPolicy
from tailguard.slo.evaluate import TierTracker
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample
from tests.slo_helpers import FakeClock, WebhookReceiver, slo_config


def test_tier_tracker_hysteresis_and_min_samples():
    tr = TierTracker("all", TierPolicy(yellow=1.8, orange=2.5, red=3.0, clear_ratio=0.9, raise_after=2,
                                       clear_after=2, min_samples=10))

    def step(v, n=100):
        return [(t.tier, t.event) for t in tr.step(v, n)]

    assert step(2.0) == [] and tr.tier == 0  # raise_after: 2
    assert step(2.0) == [("yellow", "raised")] and tr.tier == 1
    assert step(3.5) == [] and step(3.5) == [("orange", "raised"), ("red", "raised")]
    assert step(9.9, n=3) == [] and tr.tier == 3  # too few samples: hold
    assert step(2.8) == [] and step(2.8) == [] and tr.tier == 3  # 2.8 > 0.9 x 3.0: inside red's band
    assert step(2.0) == [] and step(2.0) == [("red", "cleared"), ("orange", "cleared")]
    assert tr.tier == 1
    assert step(1.7) == [] and step(1.7) == [] and tr.tier == 1  # 1.7 > 1.62: yellow holds in its band
    assert step(1.6) == [] and step(1.6) == [("yellow", "cleared")] and tr.tier == 0


def _feed(mon: SLOMonitor, clock: FakeClock, e2e: float, n: int = 10) -> str:
    clock.advance(1.0)
    for _ in range(n):
        mon.record(RequestSample(e2e=e2e, ttft=e2e / 2, queue_wait=0.0))
    return mon.evaluate().to_dict()["tier"]


def test_scale_hooks_once_per_escalation_webhook_and_command(tmp_path):
    out = tmp_path / "hook.jsonl"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"
    clock = FakeClock()
    with WebhookReceiver() as hook:
        cfg = slo_config(actions={"inline_hooks": True,
                                  "scale_out": {"webhook_url": hook.url, "command": [sys.executable, "-c", script]}})
        mon = SLOMonitor(cfg, clock=clock)
        tiers = [_feed(mon, clock, v) for v in (0.4, 0.7, 1.0, 0.7, 1.0, 0.01, 0.01, 0.5, 0.01, 0.01)]
        assert tiers == ["yellow", "orange", "red", "red", "red", "red", "green", "yellow", "yellow", "green"]
        bodies = hook.wait_for(4)
    assert [(b["action"], b["replicas_delta_pct"]) for b in bodies] == [
        ("scale_out", 10.0), ("scale_in", -10.0), ("scale_out", 10.0), ("scale_in", -10.0)]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["action"] for x in lines] == ["scale_out", "scale_in", "scale_out", "scale_in"]
    assert lines[0]["figures"]["tier_value"] == pytest.approx(0.4)
    assert lines[0]["alert_id"] is not None
    hooks = [r for r in mon.alerts(limit=None) if r["kind"] == "hook"]
    assert len(hooks) == 8 and all(r["event"] == "ok" for r in hooks)
    mon.close()


def test_a_hanging_webhook_never_blocks_evaluation():
    clock = FakeClock()
    with WebhookReceiver(delay_s=1.5) as hook:
        cfg = slo_config(actions={"scale_out": {"webhook_url": hook.url, "timeout_s": 0.3}})
        mon = SLOMonitor(cfg, clock=clock)
        t0 = time.perf_counter()
        assert _feed(mon, clock, 0.4) == "yellow"
        assert time.perf_counter() - t0 < 0.25  # the hook runs on its own thread
        assert mon.actions.hooks.flush(5)
        failed = [r for r in mon.alerts(limit=None) if r["kind"] == "hook"]
        assert failed and failed[0]["event"] == "failed" and "Timeout" in failed[0]["details"]["error"]
        mon.close()


def test_golden_rules_fire_on_healthy_lognormal_traffic():
    """Advisories, not pages: lognormal latency with log-sigma 0.6 (P99/P50 = e^(2.326 x 0.6) = 4.0, P99/P95 =
    e^(0.681 x 0.6) = 1.50) trips P99 > 3 x P50 while every baseline objective but the P99 may hold."""
    clock = FakeClock()
    mon = SLOMonitor(slo_config(tiers={"yellow": 50, "orange": 60, "red": 70}, golden_rules={"min_samples": 100}),
                     clock=clock)
    rng = np.random.default_rng(1)
    clock.advance(1)
    vals = rng.lognormal(np.log(0.3), 0.6, 20_000)
    for v in vals:
        mon.record(RequestSample(e2e=float(v), ttft=0.05))
    ev = mon.evaluate()
    rules = ev.advisories["all"]["rules"]
    exact = np.quantile(vals, 0.99) / np.quantile(vals, 0.5)
    assert exact == pytest.approx(math.exp(2.326 * 0.6), rel=0.05)
    assert rules["p99_over_p50"]["active"] and rules["p99_over_p50"]["ratio"] == pytest.approx(exact, rel=0.02)
    assert ev.to_dict()["tier"] == "green"
    adv = [r for r in mon.alerts(limit=None) if r["kind"] == "advisory"]
    assert adv[0]["name"] == "p99_over_p50" and "plan improvements now" in adv[0]["details"]["advice"]


def test_hotspots_name_the_dominant_stage():
    clock = FakeClock()
    mon = SLOMonitor(slo_config(hotspots={"min_samples": 20}), clock=clock)
    clock.advance(1)
    rng = np.random.default_rng(2)
    for i in range(200):
        base = float(rng.uniform(0.18, 0.22))
        stages = {"tokenize": 0.001, "queue": 0.01, "prefill": 0.05, "decode": base - 0.062, "stream": 0.001}
        mon.record(RequestSample(e2e=base, stages=stages, request_id=f"ok{i}"))
    slow = {"tokenize": 0.001, "queue": 2.5, "prefill": 0.05, "decode": 0.14, "stream": 0.001}
    mon.record(RequestSample(e2e=sum(slow.values()), stages=slow, request_id="slow-one"))
    hs = mon.evaluate().hotspots
    assert [r["request_id"] for r in hs["requests"]] == ["slow-one"]
    assert hs["requests"][0]["dominant_stage"] == "queue" and hs["requests"][0]["sigmas"] > 2
    assert math.exp(hs["log_mean"]) == pytest.approx(0.2, rel=0.1)


def test_broken_sink_and_failing_evaluation_do_not_stop_the_monitor():
    clock = FakeClock()

    def bad_sink(rec):
        raise RuntimeError("disk full")

    mon = SLOMonitor(slo_config(), sinks=[bad_sink], clock=clock)
    assert _feed(mon, clock, 0.4) == "yellow"
    assert mon.records.sink_errors > 0
    mon.record(object())  # not a request: logged, never raised
    calls = []

    def boom(now=None):
        calls.append(1)
        raise ValueError("bad")

    mon.evaluate = boom

    async def run_briefly():
        task = asyncio.create_task(mon.run(interval_s=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(run_briefly())
    assert len(calls) >= 2  # kept evaluating after the first failure


def test_close_waits_for_an_evaluation_in_flight():
    """Shutdown cancels the evaluation task, but its worker thread goes on: close() must wait for it, or the records
    it emits reach a store that is already closed (and the scale hooks run after they were shut down)."""
    mon = SLOMonitor(MonitorConfig())
    started = threading.Event()
    inner = mon.evaluator.evaluate

    def slow(*a, **kw):
        started.set()
        time.sleep(0.3)
        return inner(*a, **kw)

    mon.evaluator.evaluate = slow
    t = threading.Thread(target=mon.evaluate)
    t.start()
    assert started.wait(5)
    mon.close()
    assert not t.is_alive(), "close() returned while an evaluation was still running"
    t.join()
