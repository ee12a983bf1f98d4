"""The CI gate's rules are validated: a NaN or negative minimum effect, or too few bootstrap replicates, would let a
real regression pass ``--gate`` silently (NaN compares False with everything; no CI means nothing is significant)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from tailguard.bench.compare import GateRules
from tailguard.bench.fakeserver import FakeScript
from tailguard.bench.runner import execute, write_outputs
from tailguard.cli import main
from tests.bench_helpers import ScriptedTransport, bench_config

BASE = FakeScript(ttft=0.030, itl=0.004, jitter=0.2, seed=5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, str]:
    """A baseline and a candidate with a clear +20% TTFT P50 regression."""
    root = tmp_path_factory.mktemp("gate")
    for name, script in (("a", BASE), ("b", dataclasses.replace(BASE, ttft=0.036))):
        cfg = bench_config(concurrency=4, num_requests=120, profiles=("baseline",), label=name)
        res, ms = asyncio.run(execute(cfg, transport=ScriptedTransport(script), display=False))
        write_outputs(res, ms, root / name)
    return str(root / "a"), str(root / "b")


def test_the_regression_fails_the_gate(runs):
    assert main(["bench", "compare", *runs, "--gate", "--no-slo-gate", "--bootstrap", "100"]) == 1


@pytest.mark.parametrize("flag,value,says", [
    ("--min-rel", "nan", "--min-rel must be a number"),
    ("--min-abs-ms", "nan", "--min-abs-ms must be a number"),
    ("--min-rel", "-0.5", "--min-rel must be non-negative"),
    ("--min-abs-ms", "inf", "--min-abs-ms must be finite"),
    ("--bootstrap", "-1", "--bootstrap must be 0 or more"),
    ("--bootstrap", "0", "--bootstrap must be at least 10 with --gate"),
    ("--bootstrap", "5", "--bootstrap must be at least 10 with --gate"),
])
def test_compare_gate_rejects_rules_that_would_pass_any_regression(runs, capsys, flag, value, says):
    args = ["bench", "compare", *runs, "--gate", "--no-slo-gate", "--bootstrap", "100", flag, value]
    assert main(args) == 2
    out = capsys.readouterr()
    assert says in out.err and "gate: PASS" not in out.out and "Traceback" not in out.err


def test_compare_without_gate_still_takes_zero_replicates(runs):
    assert main(["bench", "compare", *runs, "--bootstrap", "0"]) == 0


@pytest.mark.parametrize("flag,value", [("--min-rel", "nan"), ("--min-abs-ms", "nan"), ("--bootstrap", "3")])
def test_ab_gate_validates_the_same_rules_before_any_request(capsys, flag, value):
    # nothing listens on these ports: the flag must be refused before any arm is tried
    args = ["bench", "ab", "--arm", "x=http://127.0.0.1:18551", "--arm", "y=http://127.0.0.1:18552",
            "--num-requests", "5", "--gate", flag, value]
    assert main(args) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("kw", [{"min_rel": math.nan}, {"min_abs": math.nan}, {"min_rel": -1.0},
                                {"min_abs": math.inf}])
def test_gate_rules_refuse_nan_and_negative_minimums(kw):
    with pytest.raises(ValueError, match="must be a finite number"):
        GateRules(**kw)
