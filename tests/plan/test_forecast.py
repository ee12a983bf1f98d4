"""Arrival forecasters, their rolling-origin backtest, and the capacity planner fed by them."""

from __future__ import annotations

import numpy as np
import pytest

from tailguard.bench.workloads import BUILTIN_TRACES
from tailguard.plan.backtest import rolling_origin, score, versus_last_value
from tailguard.plan.capacity import (
    ServiceProfile,
    plan_ahead,
    plan_capacity,
    throughput_cap,
    widest_useful_cap,
)
from tailguard.plan.forecast import (
    HoltWinters,
    LastValue,
    LSTMForecaster,
    MovingMean,
    SeasonalNaive,
    arrival_counts,
    detect_period,
    read_arrival_times,
)


def seasonal_series(n: int = 160, season: int = 12, seed: int = 3) -> np.ndarray:
    """Poisson counts around a smooth daily-like cycle: the shape a seasonal model must exploit."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = 60 + 30 * np.sin(2 * np.pi * t / season)
    return rng.poisson(level).astype(float)


# --- reading and bucketing ----------------------------------------------------------------------------------------

def test_arrival_counts_buckets_and_drops_the_partial_last_period():
    times = np.array([0.0, 0.5, 1.2, 1.9, 2.1, 2.2, 3.05])
    counts = arrival_counts(times, 1.0)
    assert counts.tolist() == [2, 2, 2]  # the single arrival of the unfinished 4th second is not a load collapse
    with pytest.raises(ValueError):
        arrival_counts(times, 0)


def test_read_arrival_times_parses_the_azure_trace(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n", encoding="utf-8")
    t = read_arrival_times(f)
    assert t[0] == 0.0 and t[1] == pytest.approx(4.314579, abs=1e-5)
    bad = tmp_path / "bad.csv"
    bad.write_text("when,x\n1,2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        read_arrival_times(bad)
    with pytest.raises(FileNotFoundError):
        read_arrival_times(tmp_path / "missing.csv")


def test_detect_period_finds_a_season_and_not_a_drifting_level():
    assert detect_period(seasonal_series()) == 12
    rng = np.random.default_rng(0)
    drift = np.cumsum(rng.normal(0, 1, 200)) + 100  # a random walk: high autocorrelation, no season
    assert detect_period(drift) is None


# --- forecasters --------------------------------------------------------------------------------------------------

def test_baselines_forecast_what_they_say():
    h = np.array([5.0, 7.0, 9.0, 4.0, 8.0, 6.0])
    assert LastValue().forecast(h, 3).tolist() == [6.0, 6.0, 6.0]
    assert MovingMean(3).forecast(h, 2).tolist() == [6.0, 6.0]
    assert SeasonalNaive(3).forecast(h, 4).tolist() == [4.0, 8.0, 6.0, 4.0]
    with pytest.raises(ValueError):
        LastValue().forecast(np.array([]), 1)
    with pytest.raises(ValueError):
        LastValue().forecast(np.array([1.0, np.nan]), 1)


def test_seasonal_models_beat_last_value_on_a_seasonal_series():
    y = seasonal_series()
    scores = rolling_origin(y, [LastValue(), HoltWinters(season=12), LSTMForecaster(window=12, max_horizon=6,
                                                                                     epochs=250, seed=0)],
                            horizons=(1, 3, 6), first_origin=100, refit_every=20)
    by = {s.name: s for s in scores}
    base = by["last-value"].mean_mae()
    assert by["holt-winters(12)"].mean_mae() < 0.8 * base
    assert by["lstm"].mean_mae() < base
    verdict = versus_last_value(scores)
    assert verdict["winner_beats_last_value"] and verdict["winner"] != "last-value"
    ci = verdict["mae_ratio_to_last_value"]["holt-winters(12)"]["overall_ci95"]
    assert ci[0] <= by["holt-winters(12)"].mean_mae() / base <= ci[1] and ci[1] < 1.0
    assert verdict["winner_beats_last_value_beyond_noise"]


def test_a_forecaster_equal_to_the_baseline_is_not_called_better():
    y = seasonal_series(n=120)

    class Copy(LastValue):
        name = "copy"

    scores = rolling_origin(y, [LastValue(), Copy()], first_origin=60)
    verdict = versus_last_value(scores)
    assert not verdict["winner_beats_last_value_beyond_noise"]
    assert verdict["mae_ratio_to_last_value"]["copy"]["overall_ci95"] == [1.0, 1.0]


def test_backtest_is_reproducible_with_fixed_seeds():
    y = seasonal_series(n=120)

    def run():
        s = rolling_origin(y, [HoltWinters(), LSTMForecaster(epochs=60, seed=7)], first_origin=90, refit_every=15)
        return [[(h.mae, h.mape, h.wape) for h in f.horizons] for f in s], [f.forecasts for f in s]

    metrics_a, preds_a = run()
    metrics_b, preds_b = run()
    assert metrics_a == metrics_b
    for a, b in zip(preds_a, preds_b):
        np.testing.assert_array_equal(a, b)


def test_backtest_never_shows_a_forecaster_the_future():
    class Peeker(LastValue):
        name = "peeker"

        def fit(self, history):
            self.seen = len(history)
            return self

        def forecast(self, history, horizon):
            assert len(history) == self.expected.pop(0)
            return super().forecast(history, horizon)

    y = np.arange(40, dtype=float)
    p = Peeker()
    p.expected = list(range(30, 35))
    rolling_origin(y, [p], horizons=(1, 6), first_origin=30)
    assert p.expected == []  # origins 30..34 each saw exactly the periods before them


def test_mape_leaves_out_zero_actuals_and_wape_does_not():
    s = score(np.array([0.0, 10.0, 20.0]), np.array([5.0, 5.0, 20.0]), 1)
    assert s.mae == pytest.approx(10 / 3)
    assert s.mape == pytest.approx(25.0) and s.mape_excluded_zero == 1
    assert s.wape == pytest.approx(100 * 10 / 30)


def test_the_azure_conv_trace_has_a_usable_series():
    counts = arrival_counts(read_arrival_times(BUILTIN_TRACES["conv"]), 60.0)
    assert counts.size >= 50 and counts.sum() > 15_000 and counts.min() > 0


# --- capacity planner ---------------------------------------------------------------------------------------------

PROFILE = ServiceProfile(mean_input_tokens=200, mean_output_tokens=48, prefill_tokens_per_s=800.0,
                         decode_tokens_per_s={1: 90.0, 16: 360.0, 64: 470.0})


def test_planner_is_monotonic_in_load():
    rates = np.linspace(0.05, 8, 60)
    fixed = [plan_capacity(r, PROFILE, max_seqs=64, replicas=4) for r in rates]
    for a, b in zip(fixed, fixed[1:]):
        assert b.max_num_seqs >= a.max_num_seqs
        assert b.max_num_batched_tokens >= a.max_num_batched_tokens
        assert b.sequences_in_service >= a.sequences_in_service  # a wider cap never lowers the sequences held
    sized = [plan_capacity(r, PROFILE) for r in rates]
    assert all(b.replicas >= a.replicas for a, b in zip(sized, sized[1:]))
    assert sized[0].replicas == 1 and sized[-1].replicas > 1
    assert all(2 <= p.max_num_seqs <= 16 and not p.saturated for p in sized)  # the seed's range, never saturated


def test_planner_keeps_utilization_and_sequences_in_bounds():
    p = plan_capacity(1.5, PROFILE, replicas=1)
    assert p.utilization <= 0.8
    assert p.max_num_seqs >= 1.25 * 1.5 * PROFILE.latency_s(p.max_num_seqs)
    assert p.max_num_batched_tokens >= p.max_num_seqs
    over = plan_capacity(50, PROFILE, replicas=1)
    assert over.saturated and over.notes
    # Overloaded: not the widest cap, but the smallest within 5% of the best request throughput in the range.
    cost = {b: PROFILE.engine_seconds_per_request(b) for b in range(2, 17)}
    assert cost[over.max_num_seqs] <= 1.05 * min(cost.values()) < cost[over.max_num_seqs - 1]
    assert over.max_num_seqs == throughput_cap(PROFILE) < 16
    # A prompt-heavy profile (prefill dominates the engine time) stops far below the bound.
    prompt_heavy = ServiceProfile(mean_input_tokens=1200, mean_output_tokens=30, prefill_tokens_per_s=400.0,
                                  decode_tokens_per_s={1: 90.0, 16: 360.0})
    assert plan_capacity(50, prompt_heavy, replicas=1).max_num_seqs <= 6


def test_burst_allowance_widens_the_cap_most_where_few_sequences_are_in_service():
    for rate in (0.2, 0.8, 1.5):
        flat = plan_capacity(rate, PROFILE, replicas=1, max_seqs=64, burst_z=0.0)
        bursty = plan_capacity(rate, PROFILE, replicas=1, max_seqs=64)
        assert bursty.max_num_seqs >= flat.max_num_seqs
    assert plan_capacity(0.8, PROFILE, replicas=1, max_seqs=64).max_num_seqs > \
        plan_capacity(0.8, PROFILE, replicas=1, max_seqs=64, burst_z=0.0).max_num_seqs


def test_kv_capacity_bounds_the_cap_and_adds_replicas():
    free = plan_capacity(1.8, PROFILE, max_seqs=64)
    tight = plan_capacity(1.8, PROFILE, max_seqs=64, kv_cache_tokens=6 * 248)  # six 200+48-token sequences
    assert free.max_num_seqs > 6 and tight.max_num_seqs <= 6
    assert tight.replicas >= free.replicas and "KV cache holds 6" in tight.notes[0]


def test_plan_ahead_plans_for_the_peak_of_the_horizon():
    calm, peak = plan_ahead([10, 10, 10], 10.0, PROFILE), plan_ahead([10, 40, 10], 10.0, PROFILE)
    assert peak.arrivals_per_s == 4.0 and peak.replicas >= calm.replicas
    with pytest.raises(ValueError):
        plan_ahead([], 10.0, PROFILE)


def test_profile_interpolates_and_rejects_nonsense():
    assert PROFILE.decode_throughput(1) == 90.0
    assert 90.0 < PROFILE.decode_throughput(8) < 360.0
    assert PROFILE.decode_throughput(500) == 470.0  # no gain beyond what was measured
    assert widest_useful_cap(PROFILE) == 64
    assert widest_useful_cap(ServiceProfile(10, 10, 100, {1: 90, 16: 360, 64: 365})) == 16
    with pytest.raises(ValueError):
        ServiceProfile(10, 0, 100, {1: 90})
    with pytest.raises(ValueError):
        plan_capacity(-1, PROFILE)


def test_profile_from_engine_throughput_result():
    data = {"results": {"tailguard native": {"prefill_tps": {"median": 800.0}, "aggregate": {
        "1": {"steady_tps": {"median": 90.0}}, "16": {"steady_tps": {"median": 360.0}}}}}}
    p = ServiceProfile.from_engine_throughput(data, 100, 20)
    assert p.decode_tokens_per_s == {1: 90.0, 16: 360.0} and p.prefill_tokens_per_s == 800.0
    with pytest.raises(ValueError, match="engine_throughput"):
        ServiceProfile.from_engine_throughput({"results": {}}, 100, 20)


# --- the forecast-driven cap controller ---------------------------------------------------------------------------

def poisson_arrivals(rates_per_period: list[float], period_s: float, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    out: list[float] = []
    for i, rate in enumerate(rates_per_period):
        n = rng.poisson(rate * period_s)
        out.extend(sorted(i * period_s + rng.uniform(0, period_s, n)))
    return out


def test_controller_raises_the_cap_ahead_of_a_ramp_and_applies_only_changes():
    from tailguard.plan.controller import ForecastCapController

    applied = []
    ctl = ForecastCapController(PROFILE, period_s=10.0, horizon=6, min_history=12, refit_every=12,
                                apply=applied.append, replicas=1, max_seqs=64, start=0.0)
    rates = [0.3] * 20 + [0.3 + 0.15 * k for k in range(1, 16)]  # calm, then a steady rise to 2.55 req/s
    arrivals = poisson_arrivals(rates, 10.0, seed=1)
    caps_by_period = []
    i = 0
    for period in range(1, len(rates) + 1):
        while i < len(arrivals) and arrivals[i] < period * 10.0:
            ctl.record_arrival(arrivals[i])
            i += 1
        ctl.advance(period * 10.0)
        caps_by_period.append(ctl.plan.max_num_seqs)
    assert ctl.history.size == len(rates) and ctl.history.sum() == len(arrivals)
    calm, late = caps_by_period[15], caps_by_period[-1]
    assert late > calm
    # each apply carried a change, and the engine never saw the same settings twice in a row
    keys = [(p.max_num_seqs, p.max_num_batched_tokens, p.replicas) for p in applied]
    assert all(a != b for a, b in zip(keys, keys[1:])) and len(applied) < len(rates)


def test_controller_counts_only_closed_periods():
    from tailguard.plan.controller import ForecastCapController

    ctl = ForecastCapController(PROFILE, period_s=10.0, start=0.0)
    for t in (1.0, 2.0, 15.0, 19.0, 21.0):
        ctl.record_arrival(t)
    assert ctl.advance(5.0) is None and ctl.history.size == 0  # the first period is still open
    ctl.advance(20.0)
    assert ctl.history.tolist() == [2.0, 2.0]  # 21.0 belongs to the open third period
    ctl.advance(45.0)
    assert ctl.history.tolist() == [2.0, 2.0, 1.0, 0.0]  # an empty period counts as zero, not as nothing
    with pytest.raises(ValueError):
        ForecastCapController(PROFILE, period_s=0)


# --- the cap-policy model ---------------------------------------------------------------------------------------

def test_model_of_one_request_alone_matches_the_throughput_curve():
    from tailguard.plan.simulate import SimRequest, simulate

    prof = ServiceProfile(300, 10, 1000.0, {1: 50.0, 16: 400.0})
    res = simulate([SimRequest(0.0, 300, 10)], prof, cap=4, token_budget=512, prefill_chunk=256)
    # two prompt chunks (256 + 44 tokens, the second yields token 1), then 9 single-sequence decode steps
    assert res.ttft_s[0] == pytest.approx(300 / 1000.0)
    assert res.e2e_s[0] == pytest.approx(300 / 1000.0 + 9 / 50.0)


def test_model_completes_every_request_and_a_wider_cap_drains_a_burst_sooner():
    from tailguard.plan.simulate import SimRequest, simulate

    burst = [SimRequest(0.0, 50, 20) for _ in range(32)]
    narrow, wide = simulate(burst, PROFILE, cap=2), simulate(burst, PROFILE, cap=32)
    for r in (narrow, wide):
        assert r.e2e_s.size == 32 and np.all(r.e2e_s >= r.ttft_s) and np.all(r.ttft_s > 0)
    assert wide.e2e_s.max() < narrow.e2e_s.max()
    with pytest.raises(ValueError):
        simulate(burst, PROFILE, cap=8, token_budget=4)


def test_model_lets_the_controller_move_the_cap():
    from tailguard.plan.controller import ForecastCapController
    from tailguard.plan.simulate import SimRequest, simulate

    rates = [0.2] * 20 + [2.5] * 20
    reqs = [SimRequest(t, 100, 20) for t in poisson_arrivals(rates, 10.0, seed=2)]
    ctl = ForecastCapController(PROFILE, period_s=10.0, min_history=6, refit_every=6, replicas=1, max_seqs=32,
                                start=0.0)
    res = simulate(reqs, PROFILE, cap=2, controller=ctl)
    s = res.summary()
    assert s["requests"] == len(reqs) and s["cap_changes"] >= 1 and s["cap_range"][1] > 2
