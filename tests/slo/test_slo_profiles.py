"""SLO profiles: the seed's built-in ones, custom YAML, and clear validation errors (file, profile, field, why)."""

from __future__ import annotations

import pytest

from tailguard.cli import main
from tailguard.serving.config import ServerConfig
from tailguard.slo.config import load_monitor_config
from tailguard.slo.profiles import Metric, ProfileError, get_profile, load_profiles


def test_builtin_profiles_carry_the_seed_figures():
    base = get_profile("baseline")
    assert [(o.metric, o.percentile, o.threshold) for o in base.objectives] == [
        (Metric.E2E, 50, 0.45), (Metric.E2E, 95, 1.2), (Metric.E2E, 99, 2.0), (Metric.ERROR_RATE, None, 0.005)]
    assert get_profile("finance").objective("e2e", 99).threshold == 1.5
    assert get_profile("strict-medical").objective("e2e", 95).threshold == 3.0
    adv = get_profile("advanced")
    assert {o.label: o.threshold for o in adv.objectives if o.metric is Metric.TTFT} == {
        "ttft_p99": 0.35, "ttft_p99[mobile]": 0.30, "ttft_p99[vip]": 0.20}


def test_custom_yaml_profiles_with_units_and_extends(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("""
profiles:
  chat-gold:
    extends: baseline
    applies_to: {business_types: chat, lanes: [vip]}
    objectives:
      - {metric: ttft, percentile: p95, threshold: 250ms}
""")
    p = load_profiles(f)["chat-gold"]
    assert p.applies_to.business_types == ("chat",) and len(p.objectives) == 5
    assert p.objective("ttft", 95).threshold == pytest.approx(0.25)


@pytest.mark.parametrize("body, expected", [
    ("profiles:\n  x:\n    objectives:\n      - {metric: e2e, threshold: 2s}\n",
     "profiles.x.objectives.0: metric 'e2e' is a latency: give a percentile"),
    ("profiles:\n  x:\n    objectives:\n      - {metric: e2e, percentile: 99, threshold: fast}\n",
     "profiles.x.objectives.0.threshold: cannot read 'fast' as a number"),
    ("profiles:\n  x:\n    objectives:\n      - {metric: error_rate, threshold: 5}\n",
     "is a rate between 0 and 1; got 5.0"),
    ("profiles:\n  x:\n    objectives:\n      - {metric: latency, percentile: 99, threshold: 1}\n",
     "profiles.x.objectives.0.metric: Input should be 'ttft'"),
    ("profiles:\n  x:\n    extends: nope\n    objectives: []\n", "profiles.x.extends: unknown SLO profile 'nope'"),
    ("profiles:\n  x:\n    objectives:\n      - {metric: e2e, percentile: 99, threshold: 1, colour: red}\n",
     "profiles.x.objectives.0.colour: Extra inputs are not permitted"),
    ("profiles: [1, 2]\n", "'profiles' must map names to profiles"),
    ("profiles:\n  x: {objectives: [\n", "not valid YAML"),
])
def test_yaml_validation_errors_are_clear(tmp_path, body, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(ProfileError) as exc:
        load_profiles(f)
    msg = str(exc.value)
    assert str(f) in msg and expected in msg, msg


def test_monitor_config_errors_name_the_field(tmp_path):
    f = tmp_path / "server.yaml"
    f.write_text("slo:\n  tiers: {yellow: 3, orange: 2.5, red: 3}\n")
    with pytest.raises(ProfileError, match=r"tier thresholds must rise: yellow 3\.0 < orange 2\.5"):
        load_monitor_config(f)
    f.write_text("slo:\n  profiles: [baseline, gold]\n")
    with pytest.raises(ValueError, match="unknown SLO profile 'gold'"):
        ServerConfig.load(f)
    f.write_text("slo:\n  peak: {mode: configured, hours: ['9-25']}\n")
    with pytest.raises(ValueError, match="peak hours '9-25': write HH:MM-HH:MM"):
        ServerConfig.load(f)


def test_serve_reports_a_bad_slo_section_and_exits(tmp_path, capsys):
    f = tmp_path / "server.yaml"
    f.write_text("model: fake\nslo:\n  actions: {shed: {status: 418}}\n")
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "bad configuration" in err and "slo.actions.shed.status" in err


def test_server_config_loads_the_slo_section_and_flags_merge(tmp_path):
    f = tmp_path / "server.yaml"
    f.write_text("model: fake\nslo:\n  profiles: [baseline, finance]\n  tiers: {yellow: 1.5}\n"
                 "  actions: {scale_out: {webhook_url: 'http://127.0.0.1:9/scale'}}\n")
    cfg = ServerConfig.load(f, slo={"actions": {"dry_run": True}})
    assert cfg.slo.profiles == ["baseline", "finance"] and cfg.slo.tiers.yellow == 1.5
    assert cfg.slo.actions.dry_run and cfg.slo.actions.scale_out.webhook_url == "http://127.0.0.1:9/scale"


def test_slo_profiles_cli_validates_a_file(tmp_path, capsys):
    f = tmp_path / "bad.yaml"
    f.write_text("profiles:\n  x:\n    objectives:\n      - {metric: ttft, percentile: 120, threshold: 1}\n")
    assert main(["slo", "profiles", "--file", str(f)]) == 2
    assert "profiles.x.objectives.0.percentile: Input should be less than 100" in capsys.readouterr().err
    assert main(["slo", "profiles"]) == 0
    assert "strict-finance" in capsys.readouterr().out
