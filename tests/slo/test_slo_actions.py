"""The red decision the server applies, and the one record type every alert and action is written as."""

from __future__ import annotations

from tailguard.slo.actions import SLORecord
from tailguard.slo.config import DegradeConfig
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample
from tests.slo_helpers import FakeClock, slo_config

FIELDS = {"id", "kind", "name", "event", "scope", "tier", "at", "started_at", "ended_at", "figures", "details",
          "dry_run", "alert_id"}


def _tick(mon: SLOMonitor, clock: FakeClock, e2e: float, n: int = 10) -> str:
    clock.advance(1.0)
    for _ in range(n):
        mon.record(RequestSample(e2e=e2e, ttft=e2e / 2, queue_wait=0.0))
    return mon.evaluate().to_dict()["tier"]


def test_the_default_red_decision_truncates():
    clock = FakeClock()
    cfg = slo_config()
    cfg.actions.degrade = DegradeConfig(probe_every=0)  # the shipped mode and cap; no probes, to test the decision
    mon = SLOMonitor(cfg, clock=clock)
    assert mon.degradation_for("chat") is None
    assert _tick(mon, clock, 1.0) == "red"
    deg = mon.degradation_for("chat")
    assert deg is not None and deg.mode == "truncate" and deg.truncates and not deg.answers_with_template
    assert deg.cap(200) == 64 and deg.cap(10) == 10  # never raises a request's own max_tokens
    assert deg.describe() == "truncate to 64 tokens"
    act = deg.slo_action()
    assert act["action"] == "degrade" and act["mode"] == "truncate" and act["max_tokens"] == 64
    assert act["tier"] == "red" and act["action_id"] == mon.actions.degrade["all"].id
    assert "e2e p99" in act["reason"]
    # The template is opt-in, and then nothing is capped.
    cfg.actions.degrade = DegradeConfig(mode="template", probe_every=0)
    mon2 = SLOMonitor(cfg, clock=clock)
    _tick(mon2, clock, 1.0)
    tpl = mon2.degradation_for("chat")
    assert tpl.answers_with_template and tpl.cap(200) == 200 and "max_tokens" not in tpl.slo_action()


def test_every_record_is_one_typed_record_and_an_end_repeats_its_start():
    clock = FakeClock()
    mon = SLOMonitor(slo_config(), clock=clock)
    for e2e in (1.0, 0.01, 0.01):
        _tick(mon, clock, e2e)
    recs = mon.alerts(limit=None)
    assert recs and all(set(r) == FIELDS for r in recs)
    by_id: dict[str, list[dict]] = {}
    for r in recs:
        by_id.setdefault(r["id"], []).append(r)
    pairs = [v for v in by_id.values() if len(v) == 2]
    # three tier alerts and three actions (and objective changes), each raised/started and then ended
    assert {(v[0]["kind"], v[0]["name"]) for v in pairs} >= {
        ("alert", "tier_yellow"), ("alert", "tier_orange"), ("alert", "tier_red"), ("action", "scale_out"),
        ("action", "shed"), ("action", "degrade")}
    for start, end in pairs:
        assert end["started_at"] == start["started_at"] and end["ended_at"] == end["at"] and start["ended_at"] is None
        assert (end["kind"], end["name"], end["scope"]) == (start["kind"], start["name"], start["scope"])
    rec = SLORecord.start("advisory", "p99_over_p50", "raised", "all", None, 5.0, figures={"ratio": 4.0})
    done = rec.end("cleared", 9.0)
    assert (done.id, done.started_at, done.ended_at, done.figures) == (rec.id, 5.0, 9.0, {})
