"""``tailguard bench compare``: deltas with CIs, and the CI gate (fails on a P50 regression, passes on identical runs)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from tailguard.bench.compare import GateRules, compare
from tailguard.bench.fakeserver import FakeScript
from tailguard.bench.runner import execute, write_outputs
from tailguard.cli import main
from tests.bench_helpers import ScriptedTransport, bench_config

BASE = FakeScript(ttft=0.030, itl=0.004, jitter=0.2, seed=5)


def _run(script: FakeScript, tmp_path=None, name: str = "", by_index: bool = True, **kw):
    cfg = bench_config(concurrency=4, num_requests=300, profiles=("baseline",), label=name, **kw)
    res, ms = asyncio.run(execute(cfg, transport=ScriptedTransport(script, by_index=by_index), display=False))
    if tmp_path is not None:
        write_outputs(res, ms, tmp_path / name)
    return res


def test_a_real_but_small_regression_passes_the_gate_and_a_lower_bar_catches_it():
    # +1.2 ms TTFT (+4%) on the same jitter draws: statistically clear, but below the default 5% bar
    a, b = _run(BASE), _run(dataclasses.replace(BASE, ttft=0.0312))
    cmp = compare(a, b, reps=300)
    ttft50 = next(r for r in cmp["rows"] if r["metric"] == "ttft" and r["percentile"] == 50)
    assert ttft50["significant"] and ttft50["delta"] > 0 and not ttft50["regression"]
    assert cmp["gate"]["pass"] and cmp["gate"]["reasons"] == []
    strict = compare(a, b, GateRules(min_rel=0.01, min_abs=0.0001), reps=300)
    assert not strict["gate"]["pass"] and strict["gate"]["reasons"][0].startswith("TTFT P50 regressed")


def test_two_runs_of_one_configuration_with_fresh_randomness_pass():
    # same script, different jitter draws: noise of a few percent must not break a build
    a, b = _run(BASE, by_index=False), _run(BASE, by_index=False)
    cmp = compare(a, b, reps=300)
    assert cmp["gate"]["pass"], cmp["gate"]["reasons"]


def test_a_scripted_p50_regression_fails_the_gate():
    a = _run(BASE)
    b = _run(dataclasses.replace(BASE, ttft=0.036))  # +6 ms TTFT (+20%)
    cmp = compare(a, b, reps=300)
    assert not cmp["gate"]["pass"]
    ttft50 = next(r for r in cmp["rows"] if r["metric"] == "ttft" and r["percentile"] == 50)
    assert ttft50["regression"] and ttft50["gated"] and ttft50["significant"]
    assert ttft50["delta"] == pytest.approx(0.006, abs=0.0015) and ttft50["ci"][0] > 0
    assert any(r.startswith("TTFT P50 regressed") for r in cmp["gate"]["reasons"])
    # ITL did not change: no regression there
    itl50 = next(r for r in cmp["rows"] if r["metric"] == "itl" and r["percentile"] == 50)
    assert not itl50["regression"]
    # an improvement is not a failure
    back = compare(b, a, reps=300)
    assert back["gate"]["pass"] and any(r["improvement"] for r in back["rows"] if r["metric"] == "ttft")


def test_an_slo_failure_of_b_fails_the_gate_unless_told_not_to():
    a = _run(BASE)
    b = _run(dataclasses.replace(BASE, ttft=0.030, itl=0.040))  # E2E ~ 470 ms: baseline wants P50 <= 450 ms
    assert b["slo"]["baseline"]["pass"] is False
    rules = GateRules(metrics=("ttft",))  # gate only TTFT, which did not change
    assert compare(a, b, rules, reps=200)["gate"]["reasons"] == ["B fails the baseline SLO profile"]
    assert compare(a, b, dataclasses.replace(rules, slo=False), reps=200)["gate"]["pass"]


def test_compare_cli_exit_codes_and_html(tmp_path, capsys):
    _run(BASE, tmp_path, "a")
    _run(BASE, tmp_path, "a2")
    _run(dataclasses.replace(BASE, ttft=0.036), tmp_path, "b")
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "a2" / "results.json"), "--gate",
                 "--bootstrap", "200"]) == 0
    assert "gate: PASS" in capsys.readouterr().out
    html = tmp_path / "cmp.html"
    out_json = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--gate", "--html", str(html),
                 "--json", str(out_json), "--bootstrap", "200"]) == 1
    out = capsys.readouterr().out
    assert "gate: FAIL" in out and "TTFT P50 regressed" in out
    doc = html.read_text(encoding="utf-8")
    assert "GATE: FAIL" in doc and 'id="fig-compare"' in doc and 'id="fig-cdf"' in doc
    # the runs are named in words, not as Python dicts; no request failed, so no failure count is shown
    assert "A = run tgb-" in doc and "{&#x27;id&#x27;" not in doc and "{'id'" not in doc
    assert "Failed requests not in the curves" not in doc and "A 0" not in doc.split("</script>", 1)[1]
    assert json.loads(out_json.read_text())["gate"]["pass"] is False
    # without --gate the comparison is only a report
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--bootstrap", "100"]) == 0


def test_compare_rejects_bad_input_with_exit_2(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"hello": 1}')
    assert main(["bench", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a tailguard bench results file" in capsys.readouterr().err
    assert main(["bench", "compare", str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    assert main(["bench", "compare", str(tmp_path / "x.json"), str(tmp_path / "x.json"),
                 "--gate-percentiles", "fifty"]) == 2
