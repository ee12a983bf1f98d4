"""A wall clock stepped back (an NTP step, a VM resume) must not hold a tier on no evidence.

The windows' slots, the tiers' evidence ageing and their minimum dwell run on a steady clock; the wall clock only
stamps what people read (records, the evaluation's time). Before, requests after a step back went into a slot whose
index lay in the future, which no query covered, and ageing and dwell measured time on the stepped clock: red held
for as long as the step (an hour here), degrading every request meanwhile."""

from __future__ import annotations

import time

from tailguard.slo.config import TierPolicy
from tailguard.slo.evaluate import TierTracker
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.windows import RequestSample, SlidingWindows
from tests.slo_helpers import FakeClock, slo_config

STEP_S = 3600.0
# Windows of five 1 s slots, and a dwell longer than the window: both must be measured on the steady clock.
CFG = {"peak_window_s": 5.0, "offpeak_window_s": 5.0, "tiers": {"min_dwell_s": 30}}


def _second(mon: SLOMonitor, clocks: list[FakeClock], e2e: float, n: int = 10) -> str:
    """One second of traffic (``n`` requests of ``e2e`` seconds), then an evaluation; returns the tier."""
    for _ in range(n):
        mon.record(RequestSample(e2e=e2e, ttft=e2e / 2, queue_wait=0.0))
    for c in clocks:
        c.advance(1.0)
    return mon.evaluate().to_dict()["tier"]


def test_red_clears_on_the_steady_clock_after_the_wall_clock_steps_back():
    wall, steady = FakeClock(), FakeClock(1000.0)
    mon = SLOMonitor(slo_config(**CFG), clock=wall, steady=steady)
    assert [_second(mon, [wall, steady], 1.0) for _ in range(3)] == ["red"] * 3
    raised_at = wall.t
    wall.advance(-STEP_S)
    tiers = [_second(mon, [wall, steady], 0.01) for _ in range(60)]
    # The healthy requests are judged at once (the window sees them), and red lets go after its dwell.
    assert mon.last.scopes["all"]["total"] == 40  # the window: the current second and the four before
    assert "red" not in tiers[30:] and tiers[-1] == "green"
    assert mon.actions.active()["degrading"] == []
    # What people read carries the wall clock, stepped or not.
    assert mon.last.at == wall.t and mon.last.scopes["all"]["end"] == wall.t
    cleared = [r for r in mon.alerts(limit=None) if r["kind"] == "alert" and r["event"] == "cleared"]
    assert cleared and all(r["at"] < raised_at for r in cleared)


def test_a_fake_clock_that_steps_back_is_judged_as_never_stepping_back():
    clock = FakeClock()  # one clock, as the server's tests give: judged by it, made never to step back
    mon = SLOMonitor(slo_config(**CFG), clock=clock)
    assert [_second(mon, [clock], 1.0) for _ in range(3)] == ["red"] * 3
    clock.advance(-STEP_S)
    tiers = [_second(mon, [clock], 0.01) for _ in range(60)]
    assert mon.last.scopes["all"]["total"] == 40  # the window: the current second and the four before
    assert "red" not in tiers[30:] and tiers[-1] == "green"


def test_the_windows_default_clock_follows_the_monotonic_clock_not_the_wall(monkeypatch):
    from tailguard.slo.windows import steady_time

    mono = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    w = SlidingWindows(slot_s=1, max_window_s=10)
    assert w.clock is steady_time
    w.record(RequestSample(e2e=0.5, ttft=0.1))
    t0 = steady_time()
    monkeypatch.setattr(time, "time", lambda: 0.0)  # the wall clock steps back to 1970
    mono[0] += 2.5
    assert steady_time() == t0 + 2.5
    w.record(RequestSample(e2e=0.5, ttft=0.1))
    assert w.query(window_s=10).total == 2


def test_the_default_monitor_judges_by_the_steady_clock(monkeypatch):
    mon = SLOMonitor(slo_config(**CFG))  # time.time stamps, the steady clock judges
    for _ in range(10):
        mon.record(RequestSample(e2e=1.0, ttft=0.5, queue_wait=0.0))
    assert mon.evaluate().to_dict()["tier"] == "red"
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - STEP_S)
    mon.clock = time.time  # the wall clock as stepped
    for _ in range(10):
        mon.record(RequestSample(e2e=1.0, ttft=0.5, queue_wait=0.0))
    ev = mon.evaluate()
    assert ev.scopes["all"]["total"] == 20  # both seconds' requests are in the window
    assert abs(ev.at - (real() - STEP_S)) < 60  # shown at the stepped wall-clock time


def test_tiers_given_a_time_that_went_back_age_and_dwell_from_it():
    # A caller that passes its own ``now`` (and steps it back) gets a dwell and an ageing measured from the step,
    # not a hold for as long as the step.
    tr = TierTracker("all", TierPolicy(yellow=1, orange=2, red=3, min_samples=5, min_dwell_s=30, clear_after=1))
    assert [t.event for t in tr.step(5.0, 10, now=10_000.0, window_s=60)] == ["raised"] * 3
    back = 10_000.0 - STEP_S
    assert tr.step(None, 0, now=back, window_s=60) == [] and tr.tier == 3  # no evidence yet: holds...
    events = tr.step(None, 0, now=back + 61, window_s=60)  # ...until a window has passed since the step
    assert [(t.tier, t.event, t.reason) for t in events] == [
        ("red", "cleared", "evidence_aged_out"), ("orange", "cleared", "evidence_aged_out"),
        ("yellow", "cleared", "evidence_aged_out")]
    # The dwell, too, counts from the step.
    assert [t.event for t in tr.step(5.0, 10, now=back + 100, window_s=60)] == ["raised"] * 3
    later = back + 100 - STEP_S
    assert tr.step(0.1, 10, now=later, window_s=60) == [] and tr.tier == 3  # dwell holds...
    assert tr.step(0.1, 10, now=later + 31, window_s=60) != [] and tr.tier == 0  # ...30 s from the step


def test_the_steady_clock_follows_the_wall_forward_and_rejoins_it_after_a_step_back(monkeypatch):
    """A gateway started before NTP set its clock must rejoin the fleet's timescale, not keep its start-up error."""
    from tailguard.slo.windows import _SteadyTime

    wall, mono = [1000.0], [50.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    clock = _SteadyTime()
    wall[0] += 600.0  # NTP sets the clock forward
    mono[0] += 1.0
    assert clock() == 1600.0  # followed at once
    wall[0] -= 10.0  # a step back: the clock goes on at the monotonic pace, never back
    mono[0] += 4.0
    assert clock() == 1604.0
    wall[0] += 20.0  # the wall clock has caught up (1610 > 1605): followed again
    mono[0] += 1.0
    assert clock() == 1610.0
