"""The SLO config refuses figures that would pass validation only to break the server later: infinities and NaNs
(an infinite Retry-After made every shed request a 500, an infinite window crashed the start), slots and evaluation
intervals so short the evaluation thread spins, and durations past any sensible bound. ``tailguard slo profiles
--config`` and ``tailguard serve --config`` read the same model, so they agree, and each error names the field."""

from __future__ import annotations

import pytest

from tailguard.cli import main
from tailguard.serving.config import ServerConfig
from tailguard.slo.config import MonitorConfig, load_monitor_config
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.profiles import ProfileError

BAD = [
    ("peak_window_s: .inf", "slo.peak_window_s", "finite number"),
    ("offpeak_window_s: .inf", "slo.offpeak_window_s", "finite number"),
    ("peak_window_s: 1e300", "slo.peak_window_s", "less than or equal to 86400"),
    ("slot_s: 1e-9", "slo.slot_s", "greater than or equal to 0.1"),
    ("slot_s: .nan", "slo.slot_s", "finite number"),
    ("eval_interval_s: 1e-9", "slo.eval_interval_s", "greater than or equal to 0.1"),
    ("eval_interval_s: 1e300", "slo.eval_interval_s", "less than or equal to 3600"),
    ("actions: {shed: {retry_after_s: .inf}}", "slo.actions.shed.retry_after_s", "finite number"),
    ("actions: {shed: {retry_after_s: 1e300}}", "slo.actions.shed.retry_after_s", "less than or equal to 86400"),
    ("actions: {scale_out: {replicas_pct: .inf}}", "slo.actions.scale_out.replicas_pct", "finite number"),
    ("actions: {scale_out: {timeout_s: .inf}}", "slo.actions.scale_out.timeout_s", "finite number"),
    ("tiers: {min_dwell_s: .inf}", "slo.tiers.min_dwell_s", "finite number"),
    ("tiers: {yellow: 1, orange: 2, red: .inf}", "slo.tiers.judge.0.red", "finite number"),
    ("peak: {baseline_half_life_s: .inf}", "slo.peak.baseline_half_life_s", "finite number"),
    ("golden_rules: {p99_over_p50: .nan}", "slo.golden_rules.p99_over_p50", "finite number"),
    ("hotspots: {sigma: .inf}", "slo.hotspots.sigma", "finite number"),
    ("actions: {scale_out: {provider: {command: 'x --port {port}', autoscale: {interval_s: 1e-9}}}}",
     "slo.actions.scale_out.provider.autoscale.interval_s", "greater than or equal to 0.05"),
]


@pytest.mark.parametrize("line, field, why", BAD, ids=[b[0] for b in BAD])
def test_unusable_figures_are_refused_naming_the_field(tmp_path, capsys, line, field, why):
    f = tmp_path / "server.yaml"
    f.write_text(f"model: fake\nslo:\n  {line}\n")
    with pytest.raises(ProfileError) as exc:
        load_monitor_config(f)
    assert f"{field}: " in str(exc.value) and why in str(exc.value), str(exc.value)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ServerConfig.load(f)
    # The validator and the server agree: both refuse, neither starts anything.
    assert main(["slo", "profiles", "--config", str(f)]) == 2
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count(field) == 2 and "Traceback" not in err, err


def test_windows_are_bounded_in_slots():
    # A day's window of 0.1 s slots would be 864,000 slots merged by every evaluation.
    with pytest.raises(ValueError, match="more than 10000 slots of slot_s") as exc:
        MonitorConfig.model_validate({"slot_s": 0.1, "peak_window_s": 60, "offpeak_window_s": 86_400})
    assert "make slot_s at least 8.64" in str(exc.value)
    cfg = MonitorConfig.model_validate({"slot_s": 8.64, "peak_window_s": 60, "offpeak_window_s": 86_400})
    assert SLOMonitor(cfg).windows.max_slots == 10_000


def test_the_bounds_leave_every_sensible_figure_alone():
    cfg = MonitorConfig.model_validate({
        "slot_s": 0.1, "eval_interval_s": 0.1, "peak_window_s": 5, "offpeak_window_s": 1000,  # 10,000 slots
        "tiers": {"min_dwell_s": 86_400, "yellow": 1, "orange": 2, "red": 86_400},
        "actions": {"shed": {"retry_after_s": 86_400}, "scale_out": {"replicas_pct": 1000}},
    })
    assert cfg.actions.shed.retry_after_s == 86_400 and cfg.slot_s == 0.1
    assert MonitorConfig().eval_interval_s == 5.0  # the defaults validate


@pytest.mark.parametrize("threshold", [float("inf"), float("nan"), "inf"])
def test_a_profile_threshold_must_be_a_finite_number(threshold):
    from tailguard.slo.profiles import ProfileError, parse_profiles

    with pytest.raises(ProfileError, match="threshold"):
        parse_profiles({"profiles": {"x": {"objectives": [
            {"metric": "ttft", "percentile": 99, "threshold": threshold}]}}})
