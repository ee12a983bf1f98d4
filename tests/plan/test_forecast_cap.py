"""Forecast-driven batch cap: the controller follows the load within bounds, the engine takes a new cap at a step
boundary without preempting anyone, and ``batch_cap: forecast`` works end to end in the server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tailguard.engine.sequence import FinishReason, SamplingParams
from tailguard.plan.capacity import ServiceProfile
from tailguard.plan.controller import ForecastCapController
from tailguard.plan.forecast import HoltWinters, LastValue
from tailguard.serving.config import BatchCapConfig, ServerConfig
from tailguard.serving.server import ThreadedServer
from tests.conftest import _make_engine
from tests.engine.test_scheduler import make_scheduler, make_seq
from tests.serving_helpers import ADMIN_KEY, make_config, wait_until

# This engine's measured throughput curve (CHANGELOG.md, 2026-12-03), short requests
PROFILE = ServiceProfile(mean_input_tokens=100, mean_output_tokens=30, prefill_tokens_per_s=821.0,
                         decode_tokens_per_s={1: 88.9, 16: 362.3, 64: 468.5})
PERIOD = 10.0


def _arrivals(rates: list[float], seed: int) -> np.ndarray:
    """Poisson arrivals, one rate per period (fixed seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, rate in enumerate(rates):
        n = rng.poisson(rate * PERIOD)
        out.extend(np.sort(rng.uniform(i * PERIOD, (i + 1) * PERIOD, n)))
    return np.asarray(out)


@pytest.mark.parametrize("forecaster", [LastValue(), HoltWinters()], ids=["last-value", "holt-winters"])
def test_cap_follows_the_forecast_up_and_down_within_bounds(forecaster):
    rates = [0.2] * 20 + [3.0] * 20 + [0.2] * 20  # calm, busy, calm (requests/s)
    applied: list[tuple[float, int, int]] = []
    ctl = ForecastCapController(PROFILE, period_s=PERIOD, horizon=3, forecaster=forecaster, min_history=10,
                                refit_every=10, start=0.0, min_seqs=2, max_seqs=16,
                                apply=lambda p: applied.append((now, p.max_num_seqs, p.max_num_batched_tokens)))
    caps_by_period = []
    times = _arrivals(rates, seed=3)
    j = 0
    for period in range(1, len(rates) + 1):
        now = period * PERIOD
        while j < times.size and times[j] < now:
            ctl.record_arrival(float(times[j]))
            j += 1
        ctl.advance(now)
        caps_by_period.append(ctl.plan.max_num_seqs)
    assert applied, "the controller never set a cap"
    assert all(2 <= c <= 16 for _, c, _ in applied)
    assert all(b >= c for _, c, b in applied), "the token budget must hold one decode per running sequence"
    calm1, busy, calm2 = caps_by_period[15:20], caps_by_period[35:40], caps_by_period[55:60]
    assert min(busy) > max(calm1), f"the cap did not rise with the load: {caps_by_period}"
    assert max(calm2) < min(busy), f"the cap did not fall back: {caps_by_period}"
    # set ahead of load: the plan holds the sequences the busy rate keeps in service (Little's law)
    assert min(busy) >= 3.0 * PROFILE.latency_s(min(busy))
    # the same arrivals give the same caps (fixed seeds, deterministic fits)
    again: list[tuple[float, int, int]] = []
    ctl2 = ForecastCapController(PROFILE, period_s=PERIOD, horizon=3, forecaster=type(forecaster)(),
                                 min_history=10, refit_every=10, start=0.0,
                                 apply=lambda p: again.append((now, p.max_num_seqs, p.max_num_batched_tokens)))
    j = 0
    for period in range(1, len(rates) + 1):
        now = period * PERIOD
        while j < times.size and times[j] < now:
            ctl2.record_arrival(float(times[j]))
            j += 1
        ctl2.advance(now)
    assert again == applied


def test_scheduler_lowers_the_cap_at_a_step_boundary_without_preempting():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=16)
    seqs = [make_seq(f"r{i}", 8, max_tokens=6) for i in range(6)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(sched.running) == 6
    sched.advance(out)
    sched.set_caps(2, 16)
    assert sched.config.max_num_seqs == 8, "a cap change waits for the next step"
    late = make_seq("late", 8, max_tokens=2)
    sched.add(late)
    finished = []
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        assert sched.config.max_num_seqs == 2 and sched.config.max_num_batched_tokens == 16
        assert not out.preempted
        if len(sched.running) > 2:  # over the lowered cap: the running ones go on, nobody new comes in
            assert late not in sched.running
            assert {c.seq.request_id for c in out.chunks} == {s.request_id for s in sched.running}
        sampling = [c.seq for c in out.chunks if c.samples]
        sched.advance(out)
        for seq in sampling:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.sampling.max_tokens:
                finished.append(seq.request_id)
                sched.finish(seq, FinishReason.LENGTH)
        assert steps < 100
    assert sorted(finished) == sorted([s.request_id for s in seqs] + ["late"])
    assert sched.num_preemptions == 0
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.set_caps(8, 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.set_caps(0)


@pytest.fixture(scope="module")
def cap_engine(tiny_gguf):
    return _make_engine(tiny_gguf, max_num_seqs=8, kv_cache_tokens=4096)


def test_engine_cap_change_mid_run_keeps_every_request_and_its_output(cap_engine):
    eng = cap_engine
    sp = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[100 + 7 * i + k for k in range(10 + i)] for i in range(6)]
    alone = eng.generate(prompts, SamplingParams(**vars(sp)))
    ids = [eng.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    got: dict[str, list[int]] = {i: [] for i in ids}
    running_seen = []
    step = 0
    while eng.has_unfinished():
        if step == 3:
            eng.set_caps(2, 32)  # from another thread in the server; here between steps
        for ev in eng.step():
            if ev.token_id is not None:
                got[ev.request_id].append(ev.token_id)
        running_seen.append(len(eng.scheduler.running))
        step += 1
    assert [got[i] for i in ids] == alone, "a cap change must not change any output"
    assert eng.stats().num_preemptions == 0
    assert eng.scheduler.config.max_num_seqs == 2
    assert max(running_seen[:3]) == 6  # all six ran before the change; they finished under the lowered cap
    eng.set_caps(8, 64)


def test_server_forecast_cap_end_to_end(tmp_path, cap_engine):
    from tailguard.engine.engine import AsyncLLMEngine

    eng = AsyncLLMEngine(cap_engine)
    cfg = make_config(tmp_path, model="tiny", batch_cap={"mode": "forecast", "period_s": 0.2, "min_history": 3,
                                                         "horizon": 2, "forecaster": "last-value",
                                                         "min_seqs": 2, "max_seqs": 6})
    try:
        with ThreadedServer(cfg, eng) as server:
            driver = server.state.batch_cap
            assert driver is not None
            assert driver.current.max_num_seqs == 6  # before any forecast: the widest cap of the range
            with httpx.Client(base_url=server.url, timeout=60) as c:
                for i in range(4):
                    r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                # every arrival was counted; periods closed and a plan within the bounds reached the engine
                assert wait_until(lambda: driver.controller.history.sum() >= 4, timeout=10)
                assert wait_until(lambda: driver.controller.plan is not None, timeout=10)
                # the engine (8 sequences as built) took the planned caps at its steps
                assert 2 <= eng.engine.scheduler.config.max_num_seqs <= 6
                metrics = c.get("/metrics").text
                gauge = f'tailguard_batch_cap_max_num_seqs{{model="{driver._model}"}} '
                line = next(ln for ln in metrics.splitlines() if ln.startswith(gauge))
                assert 2 <= float(line.removeprefix(gauge)) <= 6
                assert "tailguard_batch_cap_replicas_estimate" in metrics
            est = driver.capacity_estimate()
            assert est["replicas"] >= 1 and est["max_num_seqs"] == driver.current.max_num_seqs
            # the scale-out hook's payload carries the same estimate
            assert server.state.slo.actions.context()["capacity"].keys() == est.keys()
            assert driver._served == 4  # completed requests feed the profile's token means
    finally:
        eng.shutdown()


def test_forecast_cap_needs_an_engine_with_caps(tmp_path):
    from tailguard.engine.fake import FakeEngine
    from tailguard.serving.batch_cap import BatchCapDriver

    with pytest.raises(ValueError, match="embedded engine"):
        make_config(tmp_path, model="fake", batch_cap={"mode": "forecast"})
    with pytest.raises(ValueError, match="FakeEngine"):
        BatchCapDriver(BatchCapConfig(mode="forecast"), FakeEngine(), None, "fake")


def test_batch_cap_config_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_seqs"):
        BatchCapConfig(mode="forecast", min_seqs=8, max_seqs=4)
    with pytest.raises(ValueError):
        ServerConfig(batch_cap={"mode": "sometimes"}, admin_key=ADMIN_KEY)


class _CapsRecorder:
    """An engine double: records the caps it is given and reports the backlog the test sets."""

    def __init__(self) -> None:
        self.caps: list[tuple[int, int | None]] = []
        self.running = self.waiting = 0

    def set_caps(self, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> None:
        self.caps.append((max_num_seqs, max_num_batched_tokens))

    def stats(self):
        from tailguard.engine.engine import EngineStats

        return EngineStats(self.running, self.waiting, 100, 0, 0, 0)


@pytest.mark.parametrize("token_budget", ["planned", "engine"])
def test_backlog_keeps_the_cap_from_falling_under_load(token_budget):
    from tailguard.serving.batch_cap import BatchCapDriver

    eng = _CapsRecorder()
    cfg = BatchCapConfig(mode="forecast", forecaster="last-value", period_s=1.0, horizon=1, min_history=2,
                         token_budget=token_budget, mean_input_tokens=100, mean_output_tokens=30)
    clock = [0.0]
    driver = BatchCapDriver(cfg, eng, None, "m", clock=lambda: clock[0])
    assert eng.caps[-1][0] == 16  # before any forecast: the widest cap
    driver.record_arrival(0.0)
    for t in (1.0, 2.0, 3.0):  # one quiet arrival, then nothing: the forecast plans the smallest cap
        clock[0] = t
        driver.advance()
    assert eng.caps[-1][0] == 2
    eng.running, eng.waiting = 3, 6  # a backlog the arrivals forecast does not see
    clock[0] = 3.25
    driver.advance()
    assert eng.caps[-1][0] == 9
    eng.running, eng.waiting = 1, 0
    clock[0] = 3.5
    driver.advance()
    assert eng.caps[-1][0] == 2
    budgets = {b for _, b in eng.caps}
    if token_budget == "engine":
        assert budgets == {512}  # the engine's own budget, whatever the cap
    else:
        assert all(b is not None and b >= c for c, b in eng.caps) and len(budgets) > 1
