"""Arrival schedules (Poisson, gamma, constant) and trace replay with time and length scaling."""

from __future__ import annotations

import asyncio
import csv
from importlib import resources

import numpy as np
import pytest

from tailguard.bench import arrivals, runner
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.runner import build_plan, execute
from tailguard.bench.tokens import ApproxTokenizer
from tailguard.bench.workloads import BUILTIN_TRACES, TraceWorkload, _parse_ts, load_trace
from tests.bench_helpers import bench_config


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_hits_the_target_rate_within_5_percent_over_2000_requests(seed):
    off = arrivals.schedule("poisson", 50.0, n=2000, seed=seed)
    assert len(off) == 2000 and off[0] == 0.0 and np.all(np.diff(off) >= 0)
    assert arrivals.achieved_rate(off) == pytest.approx(50.0, rel=0.05)
    gaps = np.diff(off)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential: CV 1


def test_gamma_burstiness_sets_the_spread_and_constant_is_even():
    bursty = np.diff(arrivals.schedule("gamma", 20.0, n=3000, seed=4, burstiness=0.25))
    regular = np.diff(arrivals.schedule("gamma", 20.0, n=3000, seed=4, burstiness=4.0))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(shape)
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, rel=0.15)
    assert np.mean(bursty[1:]) == pytest.approx(0.05, rel=0.1)
    const = arrivals.schedule("constant", 8.0, n=9)
    assert np.allclose(const, np.arange(9) / 8.0)


def test_schedules_are_seeded_and_a_duration_cuts_them():
    a = arrivals.schedule("poisson", 30.0, duration=20.0, seed=9)
    b = arrivals.schedule("poisson", 30.0, duration=20.0, seed=9)
    c = arrivals.schedule("poisson", 30.0, duration=20.0, seed=10)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a[-1] < 20.0 and len(a) == pytest.approx(600, rel=0.15)
    with pytest.raises(ValueError, match="unknown arrival"):
        arrivals.schedule("weibull", 1.0, n=3)


def test_the_shipped_traces_and_their_attribution_are_package_data():
    data = resources.files("tailguard.bench") / "data"
    assert "CC-BY 4.0" in (data / "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert "Splitwise" in (data / "ATTRIBUTION.md").read_text(encoding="utf-8")
    rows = load_trace("conv")
    assert len(rows) == 19366 and rows[0].t == 0.0 and len(load_trace("code")) == 8819


def test_trace_offsets_reproduce_the_traces_inter_arrivals_after_scaling():
    with open(BUILTIN_TRACES["code"], newline="") as f:
        raw = [(_parse_ts(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
               for r in csv.DictReader(f)]
    raw.sort()
    wl = TraceWorkload(ApproxTokenizer(), source="code", speedup=4.0, length_scale=0.1, duration=60.0,
                       max_output_tokens=64)
    n = len(wl)
    expected_gaps = np.diff([t for t, _, _ in raw[:n]]) / 4.0
    assert np.max(np.abs(np.diff(wl.offsets()) - expected_gaps)) < 1e-6
    s = wl.spec(3)
    assert s.input_tokens == max(1, round(raw[3][1] * 0.1))
    assert s.max_tokens == min(64, max(1, round(raw[3][2] * 0.1)))
    assert wl.describe()["replay_rate_rps"] == pytest.approx(wl.trace_rate() * 4.0)


def test_trace_replay_sends_at_the_scaled_trace_times(monkeypatch):
    seen = {}
    orig = runner.analyse

    def spy(cfg, workload, plan_, outcome, *a, **kw):
        seen["outcome"], seen["workload"] = outcome, workload
        return orig(cfg, workload, plan_, outcome, *a, **kw)

    monkeypatch.setattr(runner, "analyse", spy)
    script = FakeScript(ttft=0.002, itl=0.001, max_lifetime=60)
    with FakeServerProcess(script) as srv:
        # the first 60 trace seconds of the conv trace (191 requests), 20x faster: 3 s of replay
        cfg = bench_config(srv.url, workload="trace", trace="conv", trace_duration=60.0, trace_speedup=20.0,
                           length_scale=0.05, max_input_tokens=64, max_output_tokens=8)
        res, ms = asyncio.run(execute(cfg, display=False))
    out, wl = seen["outcome"], seen["workload"]
    expected = np.asarray(wl.offsets())
    intended = np.asarray([r.intended - out.t0 for r in out.results])
    sent = np.asarray([r.sent - out.t0 for r in out.results])
    assert len(intended) == len(expected) == 191
    assert np.max(np.abs(np.diff(intended) - np.diff(expected))) < 1e-6  # the schedule: exactly the trace's
    # the actual sends keep to the trace's inter-arrival times: the typical error is a small fraction of the mean
    # gap (~16 ms here), and even the P90 error stays well under it (generous: a late wake-up on a shared machine
    # is real, and the bench reports it as send lag)
    err = np.abs(np.diff(sent) - np.diff(expected))
    mean_gap = float(np.mean(np.diff(expected)))
    assert np.median(err) < 0.1 * mean_gap and np.percentile(err, 90) < 0.5 * mean_gap
    assert res["run"]["workload"]["kind"] == "trace" and "CC-BY 4.0" in res["run"]["workload"]["attribution"]
    assert res["summary"]["requests"]["completed"] == len(expected)


def test_a_rate_rescales_the_trace_to_that_mean_rate():
    wl = TraceWorkload(ApproxTokenizer(), source="conv", duration=600.0)
    cfg = bench_config(workload="trace", trace="conv", rate=5.0)
    p = build_plan(cfg, wl)
    assert arrivals.achieved_rate(p.offsets) == pytest.approx(5.0, rel=1e-6)
    # the shape (relative gaps) is the trace's own
    g0, g1 = np.diff(wl.offsets()), np.diff(p.offsets)
    assert np.allclose(g1 / g1.sum(), g0 / g0.sum())
