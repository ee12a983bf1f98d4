"""One profiles file serves `tailguard serve` (the live monitor) and `tailguard bench`."""

from __future__ import annotations

import textwrap

import pytest

from tailguard.bench.profiles import BUILTIN, from_monitor_profile, load_profiles
from tailguard.slo.profiles import builtin_profiles

MONITOR_YAML = textwrap.dedent("""
    profiles:
      chat-gold:
        description: premium chat
        applies_to: {business_types: [chat]}
        objectives:
          - {metric: ttft, percentile: 95, threshold: 250ms}
          - {metric: e2e, percentile: 99, threshold: "1.5s"}
          - {metric: e2e, percentile: 50, threshold: "400ms"}
          - {metric: error_rate, threshold: "0.5%"}
          - {metric: queue_wait, percentile: 99, threshold: 100ms}
          - {metric: ttft, percentile: 99, threshold: 200ms, where: {lanes: [vip]}}
""")


def test_monitor_format_yaml_is_read_by_the_bench(tmp_path):
    f = tmp_path / "profiles.yaml"
    f.write_text(MONITOR_YAML)
    (p,) = load_profiles([str(f)])
    assert p.name == "chat-gold" and p.max_error_rate == pytest.approx(0.005)
    got = {(o.metric, o.percentile, round(o.threshold, 6), o.business_types) for o in p.objectives}
    assert got == {("ttft", 95, 0.25, ("chat",)), ("e2e", 99, 1.5, ("chat",)), ("e2e", 50, 0.4, ("chat",))}
    # Goodput bounds: each metric's highest-percentile threshold.
    assert {(b.metric, round(b.threshold, 6)) for b in p.request_bounds} == {("ttft", 0.25), ("e2e", 1.5)}
    # What the bench cannot judge is said, not silently dropped.
    assert "queue_wait_p99" in p.description and "vip" in p.description


def test_monitor_builtins_agree_with_the_bench_builtins():
    baseline = from_monitor_profile(builtin_profiles()["baseline"])
    ours = BUILTIN["baseline"]()
    key = sorted((o.metric, o.percentile, o.threshold) for o in ours.objectives)
    assert sorted((o.metric, o.percentile, o.threshold) for o in baseline.objectives) == key
    assert baseline.max_error_rate == ours.max_error_rate
    assert [(b.metric, b.threshold) for b in baseline.request_bounds] == [(b.metric, b.threshold)
                                                                           for b in ours.request_bounds]


def test_a_monitor_profile_with_nothing_the_bench_can_judge_is_refused(tmp_path):
    f = tmp_path / "lanes.yaml"
    f.write_text("profiles:\n  vip-only:\n    objectives:\n      - {metric: ttft, percentile: 99, threshold: 0.2, "
                 "where: {lanes: [vip]}}\n")
    with pytest.raises(ValueError, match="none of its objectives can be judged"):
        load_profiles([str(f)])
