"""One profiles file serves `tailguard serve` (the live monitor) and `tailguard bench`."""

from __future__ import annotations

import textwrap

import pytest

from tailguard.bench.profiles import (
    BUILTIN,
    bench_bounds,
    evaluate,
    judged_objectives,
    load_profiles,
    profile_from_dict,
)
from tailguard.slo.profiles import SLOProfile, builtin_profiles

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
    judged, not_judged = judged_objectives(p)
    got = {(o.metric.value, o.percentile, round(o.threshold, 6), p.business_types_of(o)) for o in judged}
    assert got == {("ttft", 95, 0.25, ("chat",)), ("e2e", 99, 1.5, ("chat",)), ("e2e", 50, 0.4, ("chat",))}
    # Goodput bounds: each metric's highest-percentile threshold.
    assert {(b.metric.value, round(b.threshold, 6)) for b in bench_bounds(p)} == {("ttft", 0.25), ("e2e", 1.5)}
    # What the bench cannot judge is said, not silently dropped.
    assert not_judged == ["queue_wait_p99", "ttft_p99[vip]"]
    res = evaluate(p, [], window=1.0, reps=10)
    assert "queue_wait_p99" in res["description"] and res["not_judged"] == not_judged


def test_one_profile_model_for_bench_and_monitor():
    """The bench's built-ins are the monitor's, and the bench's own YAML shape reads into the same model."""
    for name in BUILTIN:
        assert BUILTIN[name]() == builtin_profiles()[name]
    tight = profile_from_dict({"name": "tight", "extends": "baseline", "max_error_rate": 0.01,
                               "objectives": [{"metric": "e2e", "percentile": 99, "threshold": "150ms"},
                                              {"metric": "ttft", "p": 95, "threshold_ms": 80,
                                               "business_types": ["Chat"]}]})
    assert type(tight) is SLOProfile
    assert tight.objective("e2e", 99).threshold == pytest.approx(0.15)  # replaced baseline's 2 s
    assert tight.max_error_rate == 0.01 and len(tight.objectives) == 5
    assert [o.where.business_types for o in tight.objectives if o.metric.value == "ttft"] == [("chat",)]
    # The seed's finance bound holds a run without business types as a whole (bench only).
    strict = BUILTIN["strict"]()
    finance = next(o for o in strict.objectives if o.where.business_types == ("finance",))
    assert finance.all_if_unlabelled and finance.threshold == 1.5
    with pytest.raises(ValueError, match="objective metric must be one of"):
        profile_from_dict({"name": "x", "objectives": [{"metric": "latency", "percentile": 99, "threshold": 1}]})


def test_a_monitor_profile_with_nothing_the_bench_can_judge_is_refused(tmp_path):
    f = tmp_path / "lanes.yaml"
    f.write_text("profiles:\n  vip-only:\n    objectives:\n      - {metric: ttft, percentile: 99, threshold: 0.2, "
                 "where: {lanes: [vip]}}\n")
    with pytest.raises(ValueError, match="none of its objectives can be judged"):
        load_profiles([str(f)])
