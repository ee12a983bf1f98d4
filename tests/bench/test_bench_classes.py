"""Traffic classes in ``tailguard bench``: each class with its own key, share, lengths and SLO profiles, reported and
gated per class and for the whole.

The first tests run over real sockets against the fake server, which delays each class's API key by a known amount;
the gate tests go through the scripted transport (known latencies per key, no scheduling noise), so that a
regression of one class is the only difference between two runs.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
from collections import Counter

import pytest

from tailguard.bench.classes import (
    ClassedWorkload,
    assign_index,
    classes_from_file,
    classes_from_specs,
    settle_shares,
)
from tailguard.bench.compare import GateRules, compare
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.redact import redact_argv
from tailguard.bench.runner import execute, write_outputs
from tailguard.cli import main
from tests.bench_helpers import ScriptedTransport, bench_config

KEYS = {"vip": "sk-vip-7f3a91c2", "standard": "sk-std-55d0e4b8", "batch": "sk-batch-a1b2c3d4"}
# seconds of TTFT the fake server adds per key, and the gap between chunks it uses for the batch key
DELAY = {"vip": 0.0, "standard": 0.03, "batch": 0.08}
BATCH_ITL = 0.008
SCRIPT = FakeScript(ttft=0.01, itl=0.002, max_lifetime=120,
                    key_delays={KEYS[c]: d for c, d in DELAY.items()}, key_itl={KEYS["batch"]: BATCH_ITL})
LOOSE = "name: loose\nobjectives:\n  - {metric: e2e, percentile: 99, threshold: 5s}\n"


def _specs(loose_path: str) -> list[str]:
    return [f"name=vip,share=0.2,key={KEYS['vip']},profile=strict,prompt-tokens=16,output-tokens=6",
            f"name=standard,share=50%,key={KEYS['standard']}",
            f"name=batch,key={KEYS['batch']},profile={loose_path},output-tokens=20"]  # takes the rest: 0.3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One run of three classes against the fake server: (results, per-request metrics, server records, dir)."""
    out = tmp_path_factory.mktemp("classes")
    loose = out / "loose.yaml"
    loose.write_text(LOOSE)
    classes = tuple(classes_from_specs(_specs(str(loose))))
    with FakeServerProcess(SCRIPT) as srv:
        cfg = bench_config(srv.url, rate=60, num_requests=160, output_tokens=10, profiles=("baseline",),
                           classes=classes, seed=4)
        res, ms = asyncio.run(execute(cfg, display=False))
        records = {r["request_id"]: r for r in srv.records()}
    write_outputs(res, ms, out)
    return res, ms, records, out


def _p(metrics: dict, name: str, q: str = "p50") -> float:
    return metrics[name]["percentiles"][q]["value"]


def test_each_class_sees_its_own_delay_over_real_sockets(served):
    res, ms, _, _ = served
    by = res["classes"]["by_class"]
    assert list(by) == ["vip", "standard", "batch"]
    assert all(by[c]["requests"]["failed"] == 0 for c in by)
    ttft = {c: _p(by[c]["metrics"], "ttft") for c in by}
    # medians of interleaved requests: the machine's noise falls on every class alike, the scripted delay on one
    assert ttft["standard"] - ttft["vip"] > 0.5 * (DELAY["standard"] - DELAY["vip"])
    assert ttft["batch"] - ttft["standard"] > 0.5 * (DELAY["batch"] - DELAY["standard"])
    for c in by:  # and every class's P95/P99 sit at or above its P50
        m = by[c]["metrics"]
        for name in ("ttft", "itl", "e2e"):
            assert _p(m, name, "p50") <= _p(m, name, "p95") <= _p(m, name, "p99")
    itl = {c: _p(by[c]["metrics"], "itl") for c in by}
    assert itl["batch"] > 2 * itl["vip"] and itl["batch"] > 2 * itl["standard"]
    # the class's output length is what it asked for; the whole mixes them
    assert {m.max_tokens for m in ms if m.traffic_class == "vip"} == {6}
    assert {m.max_tokens for m in ms if m.traffic_class == "batch"} == {20}
    assert {m.max_tokens for m in ms if m.traffic_class == "standard"} == {10}
    # the whole run's figures stand beside the classes'
    assert res["summary"]["requests"]["measured"] == sum(by[c]["requests"]["measured"] for c in by) == 160
    assert _p(res["metrics"], "ttft", "p99") >= ttft["batch"]


def test_shares_are_honoured_and_the_key_reaches_the_server_per_class(served):
    res, ms, records, _ = served
    by = res["classes"]["by_class"]
    planned = {"vip": 0.2, "standard": 0.5, "batch": 0.3}
    for c, share in planned.items():
        assert by[c]["share_planned"] == pytest.approx(share)
        assert abs(by[c]["share_sent"] - share) < 0.1, (c, by[c]["share_sent"])
    for m in ms:
        assert records[m.request_id]["_api_key"] == KEYS[m.traffic_class]
    assert Counter(records[m.request_id]["_api_key"] for m in ms) == Counter(KEYS[m.traffic_class] for m in ms)


def test_results_file_and_csv_record_each_request_s_class(served):
    res, ms, _, out = served
    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    cl = data["classes"]
    assert cl["assignment"] == "share"
    assert [d["name"] for d in cl["definitions"]] == ["vip", "standard", "batch"]
    assert all(d["key"] == "***" for d in cl["definitions"])
    by = cl["by_class"]
    # each class judged by its own profiles; the one naming none by the run's
    assert list(by["vip"]["slo"]) == ["strict"] and list(by["batch"]["slo"]) == ["loose"]
    assert list(by["standard"]["slo"]) == ["baseline"] and by["standard"]["profiles_from"] == "run"
    for c, d in by.items():
        for name in ("ttft", "itl", "tpot", "e2e"):
            for q in ("p50", "p95", "p99"):
                assert d["metrics"][name]["percentiles"][q]["value"] is not None, (c, name, q)
        assert set(d["goodput_rps"]) == set(d["slo"]) and all(v is not None for v in d["goodput_rps"].values())
    assert by["batch"]["pass"] is True  # 5 s of room
    assert cl["whole"]["profiles"] == ["baseline"] and "baseline" in data["slo"]
    # the samples name each request's class, aligned with its index
    s = data["samples"]
    want = {m.index: m.traffic_class for m in ms}
    assert len(s["class"]) == len(s["index"]) and all(want[i] == c for i, c in zip(s["index"], s["class"]))
    with (out / "requests.csv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert {r["request_id"]: r["class"] for r in rows} == {m.request_id: m.traffic_class for m in ms}
    for name in ("results.json", "requests.csv", "report.html"):
        text = (out / name).read_text(encoding="utf-8")
        assert not any(k in text for k in KEYS.values()), name


def test_report_has_the_class_table_and_chart(served):
    res, _, _, out = served
    doc = (out / "report.html").read_text(encoding="utf-8")
    assert "<h2>Traffic classes</h2>" in doc and 'id="fig-classes"' in doc
    assert "Percentiles by traffic class" in doc
    for c in ("vip", "standard", "batch"):
        n = res["classes"]["by_class"][c]["requests"]["completed"]
        assert f"{c} (n = {n})" in doc  # the chart's categories, with their sample sizes
        assert f"Verdicts of class {c}" in doc
    assert f"all (n = {res['summary']['requests']['completed']})" in doc
    for label in ("TTFT P50", "TTFT P95", "TTFT P99", "ITL P99", "E2E P99"):
        assert f"<th>{label}</th>" in doc


# --- the gate, per class (scripted latencies: known, no noise) -----------------------------------------------

class KeyedTransport(ScriptedTransport):
    """The scripted transport with a TTFT per API key (and a small, index-bound spread), like the fake server's."""

    def __init__(self, ttft_by_key: dict[str, float], gap: float = 0.004, fail=None) -> None:
        super().__init__(FakeScript(), by_index=True, fail=fail)
        self.ttft_by_key = ttft_by_key
        self.gap = gap
        self.keys: list[tuple[int, str]] = []

    async def post(self, url, body, headers, res, stream, chat) -> None:
        key = headers.get("Authorization", "").removeprefix("Bearer ")
        self.keys.append((res.index, key))
        base = self.ttft_by_key[key]
        self.latency = lambda i: (base * (1 + 0.2 * ((i * 37) % 11) / 10), self.gap)
        await super().post(url, body, headers, res, stream, chat)


FAST = "name: vip-fast\nobjectives:\n  - {metric: ttft, percentile: 50, threshold: 65ms}\n"
TTFT_A = {KEYS["vip"]: 0.05, KEYS["standard"]: 0.10, KEYS["batch"]: 0.30}


def _gate_run(tmp_path, name: str, ttft: dict[str, float], seed: int = 1, fail=None):
    fast = tmp_path / "vip-fast.yaml"
    fast.write_text(FAST)
    classes = tuple(classes_from_specs([f"name=vip,share=0.15,key={KEYS['vip']},profile={fast}",
                                        f"name=standard,share=0.55,key={KEYS['standard']}",
                                        f"name=batch,share=0.3,key={KEYS['batch']}"]))
    cfg = bench_config(concurrency=4, num_requests=300, profiles=("baseline",), classes=classes, seed=seed,
                       label=name, api_key="sk-run-level-0000")
    tr = KeyedTransport(ttft, fail=fail)
    res, ms = asyncio.run(execute(cfg, transport=tr, display=False))
    write_outputs(res, ms, tmp_path / name)
    return res, tr


def test_a_regression_of_one_class_fails_the_gate_and_names_it(tmp_path, capsys):
    a, tr_a = _gate_run(tmp_path, "a", TTFT_A)
    b, tr_b = _gate_run(tmp_path, "b", {**TTFT_A, KEYS["vip"]: 0.07})  # vip +20 ms; the others unchanged
    # one seed, one schedule: each arrival has the same class (and key) in both runs
    assert a["samples"]["class"] == b["samples"]["class"] and tr_a.keys == tr_b.keys
    assert all(k == KEYS[c] for (i, k), c in zip(sorted(tr_a.keys)[1:], a["samples"]["class"]))
    cmp = compare(a, b, reps=300)
    assert not cmp["gate"]["pass"] and cmp["gate"]["failed_classes"] == ["vip"]
    reasons = cmp["gate"]["reasons"]
    assert any(r.startswith("class vip: TTFT P50 regressed") for r in reasons)
    assert "class vip: B fails the vip-fast SLO profile" in reasons
    assert not any("standard" in r or "batch" in r for r in reasons)
    # the whole run's P50 rests on the standard class, which did not move: no whole-run reason
    assert all(r.startswith("class vip:") for r in reasons)
    vip50 = next(d for d in cmp["classes"]["by_class"]["vip"]["rows"]
                 if d["metric"] == "ttft" and d["percentile"] == 50)
    assert vip50["regression"] and vip50["gated"] and vip50["delta"] == pytest.approx(0.02, rel=0.25)
    std = cmp["classes"]["by_class"]["standard"]
    assert not any(d["regression"] for d in std["rows"]) and std["reasons"] == []

    # the CLI: exit 1, the class named; gating the other classes only passes; the HTML has the class tables
    html = tmp_path / "cmp.html"
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--gate", "--bootstrap", "200",
                 "--html", str(html)]) == 1
    out = capsys.readouterr().out
    assert "gate: FAIL" in out and "class vip: TTFT P50 regressed" in out and "by traffic class" in out
    doc = html.read_text(encoding="utf-8")
    assert "By traffic class" in doc and "class vip" in doc and "B fails the vip-fast SLO profile" in doc
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--gate", "--bootstrap", "200",
                 "--gate-classes", "standard,batch"]) == 0
    assert "gate: PASS" in capsys.readouterr().out


def test_two_runs_of_one_schedule_pass_the_class_gate(tmp_path):
    a, _ = _gate_run(tmp_path, "a", TTFT_A)
    b, _ = _gate_run(tmp_path, "b", TTFT_A)
    cmp = compare(a, b, reps=200)
    assert cmp["gate"]["pass"], cmp["gate"]["reasons"]
    assert cmp["classes"]["shared"] == ["vip", "standard", "batch"] and cmp["gate"]["failed_classes"] == []
    # and with no gated class, only the whole run gates
    assert compare(a, b, GateRules(classes=()), reps=100)["classes"]["gated"] == []


def test_a_class_key_echoed_by_the_server_is_scrubbed(tmp_path):
    res, _ = _gate_run(tmp_path, "echo", TTFT_A, fail=lambda i: "429" if i % 5 == 0 else None)
    assert res["summary"]["requests"]["failed"] == 60
    assert sum(d["requests"]["failed"] for d in res["classes"]["by_class"].values()) == 60
    for name in ("results.json", "requests.csv", "report.html"):
        text = (tmp_path / "echo" / name).read_text(encoding="utf-8")
        assert not any(k in text for k in KEYS.values()), name
    assert "too many requests for Bearer ***" in (tmp_path / "echo" / "requests.csv").read_text(encoding="utf-8")
    # the failures are misses of their own class only
    s = res["samples"]
    assert len(s["failed_class"]) == 60 and set(s["failed_class"]) <= {"vip", "standard", "batch"}


def test_the_recorded_command_masks_class_keys():
    argv = ["--class", "name=vip,key=sk-1234567,share=0.1,header=X-Api-Key:zzz,header=X-Lane:core",
            "--class=name=b,api-key=sk-999"]
    assert redact_argv(argv) == ["--class", "name=vip,key=***,share=0.1,header=X-Api-Key:***,header=X-Lane:core",
                                 "--class=name=b,api-key=***"]


# --- assignment ---------------------------------------------------------------------------------------------

def test_assignment_is_deterministic_per_seed_and_honours_shares():
    classes = classes_from_specs(["name=a,share=0.1", "name=b,share=0.6", "name=c"])
    wl = ClassedWorkload(_Base(), classes, seed=3)
    first = [wl.class_of(i).name for i in range(20_000)]
    assert first == [ClassedWorkload(_Base(), classes, seed=3).class_of(i).name for i in range(20_000)]
    other = [ClassedWorkload(_Base(), classes, seed=4).class_of(i).name for i in range(20_000)]
    assert first != other
    counts = Counter(first)
    for name, share in (("a", 0.1), ("b", 0.6), ("c", 0.3)):
        assert abs(counts[name] / 20_000 - share) < 0.015
    # a class's arrivals do not depend on how many requests the run sends
    assert [wl.class_of(i).name for i in range(100)] == first[:100]
    cum = [0.1, 0.7, 1.0]
    assert [assign_index(i, 3, cum) for i in range(50)] == [[c.name for c in classes].index(x) for x in first[:50]]
    spec = wl.spec(7)
    assert spec.traffic_class == first[7]


class _Base:
    name = "base"

    def spec(self, i: int):
        from tailguard.bench.workloads import RequestSpec

        return RequestSpec(prompt=f"p{i}", max_tokens=8)

    def describe(self) -> dict:
        return {"kind": "test"}


def test_shares_settle_to_one():
    got = settle_shares(classes_from_specs(["name=a,share=0.1", "name=b,share=0.6", "name=c"]))
    assert [c.share for c in got] == [0.1, 0.6, pytest.approx(0.3)] and math.isclose(sum(c.share for c in got), 1)
    with pytest.raises(ValueError, match="must add up to 1, got 0.9"):
        settle_shares(classes_from_specs(["name=a,share=0.3", "name=b,share=0.6"]))
    # a trace's column names the classes: no shares needed
    assert settle_shares(classes_from_specs(["name=a", "name=b"]), by_column=True)[0].share is None


def test_classes_file_yaml_and_json(tmp_path):
    y = tmp_path / "classes.yaml"
    y.write_text("column: tier\nclasses:\n  - {name: vip, share: 10%, key: sk-v, profile: [strict, baseline],"
                 " prompt-tokens: 64, langs: en+zh}\n  - {name: rest, input_tokens: 32, header: ['X-Lane: bulk']}\n")
    classes, column = classes_from_file(y)
    assert column == "tier"
    assert classes[0].share == pytest.approx(0.1) and classes[0].profile == ("strict", "baseline")
    assert classes[0].langs == ("en", "zh") and classes[1].prompt_tokens == 32
    assert classes[1].header == {"X-Lane": "bulk"}
    j = tmp_path / "classes.json"
    j.write_text(json.dumps([{"name": "a", "share": 0.5}, {"name": "b", "share": 0.5, "output_tokens": 9}]))
    classes, column = classes_from_file(j)
    assert [c.name for c in classes] == ["a", "b"] and column is None and classes[1].output_tokens == 9


# --- a trace's class column -----------------------------------------------------------------------------------

def _trace(tmp_path, names: list[str]):
    p = tmp_path / "trace.csv"
    with p.open("w", encoding="utf-8") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens,Class\n")
        for i, name in enumerate(names):
            f.write(f"{i * 0.01:.3f},{20 + i % 7},{4 + i % 3},{name}\n")
    return p


def test_a_trace_column_names_each_request_s_class(tmp_path):
    names = ["vip", "standard", "standard", "batch", "standard"] * 8
    trace = _trace(tmp_path, names)
    classes = tuple(classes_from_specs([f"name={c},key={KEYS[c]}" for c in KEYS]))
    cfg = bench_config(workload="trace", trace=str(trace), trace_speedup=20.0, classes=classes,
                       class_column="class", profiles=("baseline",))
    tr = KeyedTransport(TTFT_A)
    res, ms = asyncio.run(execute(cfg, transport=tr, display=False))
    assert res["classes"]["assignment"] == "column" and res["classes"]["column"] == "class"
    assert [m.traffic_class for m in ms] == names  # row by row, in the trace's order
    assert {c: d["requests"]["measured"] for c, d in res["classes"]["by_class"].items()} == Counter(names)
    assert all(d["share_planned"] is None for d in res["classes"]["by_class"].values())
    assert all(k == KEYS[names[i]] for i, k in tr.keys if i >= 0)


def test_cli_reads_the_class_column_and_refuses_unknown_names(tmp_path, capsys):
    trace = _trace(tmp_path, ["vip", "gold", "vip"])
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--trace", str(trace), "--tokenizer",
               "approx", "--class", "name=vip", "--class", "name=standard"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "names classes that no class defines: gold" in err and err.count("\n") == 1


# --- bad input ----------------------------------------------------------------------------------------------

U = ["--url", "http://127.0.0.1:9", "--model", "m"]


@pytest.mark.parametrize("argv, message", [
    (["--class", "vip"], "--class wants FIELD=VALUE pairs"),
    (["--class", "name=vip,shar=0.1"], "class 'vip': unknown field 'shar'"),
    (["--class", "name=vip,share=-1"], "class 'vip': share: input should be greater than 0"),
    (["--class", "name=vip,share=lots"], "class 'vip': share: input should be a valid number"),
    (["--class", "name=a,share=0.3", "--class", "name=b,share=0.6"], "class shares must add up to 1, got 0.9"),
    (["--class", "name=a", "--class", "name=b"], "at most one class may leave its share out"),
    (["--class", "name=a,share=0.5", "--class", "name=a"], "two classes are named 'a'"),
    (["--class", "name=v,profile=gold"], "class 'v': SLO profile: unknown SLO profile 'gold'"),
    (["--class", "name=v,key-env=TAILGUARD_TEST_UNSET_KEY"], "TAILGUARD_TEST_UNSET_KEY (key-env) is not set"),
    (["--class", "name=v,key=a,key-env=B"], "give key or key-env, not both"),
    (["--class", "name=v,langs=en+fr"], "unknown language 'fr'"),
    (["--class", "name=v,output-tokens=0"], "output-tokens: input should be greater than or equal to 1"),
    (["--class", "name=v w"], "a class name is letters, digits"),
    (["--class", "name=v,header=novalue"], "a header is NAME:VALUE"),
    (["--class-column", "class"], "give the classes too"),
    (["--class", "name=v", "--class-column", "class"], "--class-column reads a column of a replayed trace"),
    (["--classes", "/nonexistent/classes.yaml"], "--classes: no such file"),
])
def test_bad_class_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TAILGUARD_TEST_UNSET_KEY", raising=False)
    assert main(["bench", *U, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


def test_bad_classes_files(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  - {name: vip, share: 0.1, promt-tokens: 3}\n")
    assert main(["bench", *U, "--classes", str(bad)]) == 2
    assert "class 'vip': unknown field 'promt-tokens'" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("classes: [\n")
    assert main(["bench", *U, "--classes", str(broken)]) == 2
    assert "not YAML or JSON (line 2" in capsys.readouterr().err
    empty = tmp_path / "empty.yaml"
    empty.write_text("classes: []\n")
    assert main(["bench", *U, "--classes", str(empty)]) == 2
    assert "classes: list should have at least 1 item" in capsys.readouterr().err
    both = tmp_path / "ok.yaml"
    both.write_text("classes:\n  - {name: a}\n")
    assert main(["bench", *U, "--classes", str(both), "--class", "name=b"]) == 2
    assert "not both" in capsys.readouterr().err
    # a profile named in a classes file is found next to it
    (tmp_path / "loose.yaml").write_text(LOOSE)
    rel = tmp_path / "rel.yaml"
    rel.write_text("classes:\n  - {name: a, profile: loose.yaml}\n")
    assert main(["bench", *U, "--classes", str(rel), "--num-requests", "1", "--tokenizer", "approx"]) == 2
    assert "did not answer the probe" in capsys.readouterr().err  # got past validation, to the (absent) server


def test_fake_server_key_flags_are_checked(capsys):
    assert main(["bench", "fake-server", "--key-delay", "sk-x=soon"]) == 2
    assert "--key-delay wants KEY=SECONDS" in capsys.readouterr().err


def test_without_classes_nothing_changes(tmp_path):
    res, ms = asyncio.run(execute(bench_config(concurrency=2, num_requests=20), transport=ScriptedTransport(
        FakeScript()), display=False))
    assert "classes" not in res and "class" not in res["samples"] and all(m.traffic_class is None for m in ms)
    write_outputs(res, ms, tmp_path)
    assert "Traffic classes" not in (tmp_path / "report.html").read_text(encoding="utf-8")
