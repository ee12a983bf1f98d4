"""``tailguard bench ab``: one replayed trace against two arms in alternating repeats, written up in one report.

Over real sockets: the baseline arm is a running fake server (a URL), the other a command that starts a fake server
50 ms slower to its first token, once per repeat. The tests check that the figures show the known delay,
that the repeats alternate, that both arms were sent the identical schedule (the fake servers log every request they
receive), that each command arm's server is started and stopped at each repeat, that replica-seconds match the wall
time and the replicas, and that bad input ends in one clear line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tailguard.bench.ab import parse_replica_seconds, plan_runs
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.redact import command_line
from tailguard.bench.workloads import busiest_window
from tailguard.cli import main

FAST_TTFT, SLOW_TTFT = 0.01, 0.06  # the two arms' scripted time to first token
KEYS = {"vip": "sk-vip-5c1e9a77", "std": "sk-std-0b8d2f41"}
# a tiny, fast replay: the busiest 3 s of the shipped conversation trace, twice as fast, short prompts and answers
SCHEDULE = ["--trace", "conv", "--window", "busiest:3", "--time-scale", "2", "--max-input-tokens", "48",
            "--max-output-tokens", "6", "--tokenizer", "approx", "--bootstrap", "100", "--profiles", "baseline"]
CLASSES = ["--class", f"name=vip,share=0.3,key={KEYS['vip']}", "--class", f"name=std,key={KEYS['std']}"]


def fake_command(log: Path, ttft: float, replicas: int = 0) -> str:
    """A command that starts a fake server on the port the bench gives it, logging what it receives."""
    return (f"{sys.executable} -m tailguard.bench.fakeserver --port {{port}} --ttft {ttft} --itl 0.002 "
            f"--replicas {replicas} --max-lifetime 120 --received-log {log}")


def received(log: Path) -> dict[str, list[tuple]]:
    """run ID -> what each of its measured requests carried, in index order (the unmeasured probes left out)."""
    runs: dict[str, list[tuple]] = defaultdict(list)
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if r["request_id"].startswith("probe-"):
            continue
        run, _, index = r["request_id"].rpartition("-")
        runs[run].append((int(index), r["prompt_sha256"], r["max_tokens"], r["key"]))
    return {k: sorted(v) for k, v in runs.items()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def ab(tmp_path_factory):
    """One A/B run: before = a running fake server (URL, 2 declared replicas), after = a command starting a slower
    fake server that exports replica-seconds as a 3-replica gateway; 2 repeats, traffic classes, --gate."""
    out = tmp_path_factory.mktemp("ab")
    a_log, b_log = out / "before-received.jsonl", out / "after-received.jsonl"
    script = FakeScript(ttft=FAST_TTFT, itl=0.002, max_lifetime=120, received_log=str(a_log))
    with FakeServerProcess(script) as srv:
        rc = main(["bench", "ab", "--arm", f"before={srv.url}",
                   "--arm", f"after=cmd:{fake_command(b_log, SLOW_TTFT, replicas=3)}", "--replicas", "before=2",
                   "--repeats", "2", *SCHEDULE, *CLASSES, "--gate", "--output-dir", str(out / "run")])
    return rc, json.loads((out / "run" / "results.json").read_text()), out, a_log, b_log


def _p50(res: dict, arm: str, metric: str) -> float:
    return res["arms"][arm]["pooled"]["metrics"][metric]["percentiles"]["p50"]["value"]


def test_each_arm_shows_its_known_delay_and_the_gate_catches_it(ab, capsys):
    rc, res, out, _, _ = ab
    delay = SLOW_TTFT - FAST_TTFT
    for metric in ("ttft", "e2e"):  # generous margins: two shared vCPUs
        diff = _p50(res, "after", metric) - _p50(res, "before", metric)
        assert 0.5 * delay < diff < 1.8 * delay, (metric, diff)
    ratio = res["ratios"]["after"]["figures"]["ttft.p50"]
    assert ratio["ratio"] > 2 and ratio["baseline"] == _p50(res, "before", "ttft")
    # pooled over both repeats, with a CI around each percentile and each repeat's own figure beside it
    for arm in ("before", "after"):
        a = res["arms"][arm]
        p99 = a["pooled"]["metrics"]["e2e"]["percentiles"]["p99"]
        assert p99["ci"][0] <= p99["value"] <= p99["ci"][1]
        sp = a["spread"]["e2e"]["p99"]
        assert len(sp["values"]) == 2 and sp["min"] <= sp["max"]
        assert a["pooled"]["summary"]["requests"]["measured"] == 2 * a["repeats"][0]["requests"]["measured"]
        assert a["capacity"]["swept"] is False and a["capacity"]["note"].startswith("not swept")
        assert set(a["pooled"]["classes"]["by_class"]) == {"vip", "std"}
    # the gate (bench compare's rules, the first arm the baseline) fails on the slower arm
    assert rc == 1 and res["gate"]["pass"] is False and res["gate"]["baseline"] == "before"
    assert any(r.startswith("TTFT P50 regressed") for r in res["gate"]["by_arm"]["after"]["reasons"])
    html = (out / "run" / "report.html").read_text()
    for needle in ('id="fig-ab-percentiles"', 'id="fig-ab-sankey"', 'id="fig-ab-sankey-tail"',
                   'id="fig-ab-classes"', "Change against before", "Where the time went", "Cost",
                   "Highest rate that meets the SLO", "Not swept", "GATE: FAIL"):
        assert needle in html, needle
    for key in KEYS.values():  # class keys appear in no output
        assert key not in html and key not in json.dumps(res)
    # the pooled runs of each arm can go straight into bench compare
    assert main(["bench", "compare", str(out / "run" / "arms" / "before" / "pooled.json"),
                 str(out / "run" / "arms" / "after" / "pooled.json")]) == 0
    assert "TTFT" in capsys.readouterr().out


def test_the_repeats_alternate(ab):
    _, res, _, _, _ = ab
    assert [(o["arm"], o["repeat"]) for o in res["order"]] == [("before", 1), ("after", 1), ("after", 2),
                                                               ("before", 2)]
    started = [r["started_at"] for a in res["arms"].values() for r in a["repeats"]]
    by_position = sorted((r["position"], r["started_at"]) for a in res["arms"].values() for r in a["repeats"])
    assert [s for _, s in by_position] == sorted(started)  # the recorded order is the order they ran in
    assert plan_runs(["A", "B"], 3, "abba") == plan_runs(["A", "B"], 3)
    assert [s.arm for s in plan_runs(["A", "B"], 3)] == ["A", "B", "B", "A", "A", "B"]
    assert [s.arm for s in plan_runs(["A", "B"], 2, "abab")] == ["A", "B", "A", "B"]


def test_both_arms_were_sent_the_identical_schedule(ab):
    _, res, _, a_log, b_log = ab
    runs = {**received(a_log), **received(b_log)}
    assert len(runs) == 4  # two repeats of each arm, each seen by the server that took it
    planned = res["schedule"]["by_scale"]["2"]["planned_requests"]
    assert planned == 40  # the busiest 3 s of the trace
    sequences = list(runs.values())
    assert all(len(s) == planned for s in sequences)
    assert all(s == sequences[0] for s in sequences)  # the same prompts, lengths and class keys, in the same order
    assert {k for *_, k in sequences[0]} == set(KEYS.values())
    assert res["schedule"]["identical"] and len(res["schedule"]["by_scale"]["2"]["fingerprints"]) == 1


def test_a_command_arm_is_started_and_stopped_at_each_repeat(ab):
    _, res, out, _, b_log = ab
    procs = [r["process"] for r in res["arms"]["after"]["repeats"]]
    assert len({p["pid"] for p in procs}) == 2 and len(received(b_log)) == 2
    for p in procs:
        assert p["stopped_by"] == "SIGTERM" and p["ready_s"] < 30
        assert not alive(p["pid"])  # no server left behind
        assert (out / "run" / p["log"]).is_file()
    assert all(r["process"] is None for r in res["arms"]["before"]["repeats"])  # a URL arm is used as is


def test_replica_seconds_are_wall_time_times_replicas(ab):
    _, res, _, _, _ = ab
    for r in res["arms"]["before"]["repeats"]:  # declared: exactly replicas x wall time
        c = r["cost"]
        assert c["source"] == "declared replicas x wall time" and c["replica_seconds"] == pytest.approx(2 * c["wall_s"])
    for r in res["arms"]["after"]["repeats"]:  # read from the gateway's counter before and after the run
        c = r["cost"]
        assert c["source"] == "gateway /metrics"
        assert c["replica_seconds"] == pytest.approx(3 * c["wall_s"], rel=0.2, abs=0.3)
    cost = res["arms"]["after"]["cost"]
    assert cost["replica_seconds"] == pytest.approx(sum(r["cost"]["replica_seconds"]
                                                        for r in res["arms"]["after"]["repeats"]))
    assert res["ratios"]["after"]["figures"]["cost.replica_seconds"]["ratio"] is not None


def test_sweep_scales_give_the_highest_passing_rate(tmp_path):
    profile = tmp_path / "fast.yaml"  # the fast arm meets it, the slow one never does
    profile.write_text("name: fast\nobjectives:\n  - {metric: ttft, percentile: 50, threshold: 40ms}\n")
    fast = FakeScript(ttft=FAST_TTFT, itl=0.002, max_lifetime=120)
    slow = FakeScript(ttft=SLOW_TTFT, itl=0.002, max_lifetime=120)
    with FakeServerProcess(fast) as a, FakeServerProcess(slow) as b:
        rc = main(["bench", "ab", "--arm", f"fast={a.url}", "--arm", f"slow={b.url}", "--repeats", "1",
                   "--trace", "conv", "--window", "busiest:2", "--max-input-tokens", "32", "--max-output-tokens",
                   "4", "--tokenizer", "approx", "--bootstrap", "50", "--profiles", str(profile),
                   "--sweep-scales", "1,2", "--quiet", "--output-dir", str(tmp_path / "run")])
    assert rc == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [(o["arm"], o["scale"]) for o in res["order"]] == [("fast", 1), ("slow", 1), ("fast", 2), ("slow", 2)]
    fast_cap, slow_cap = res["arms"]["fast"]["capacity"], res["arms"]["slow"]["capacity"]
    assert fast_cap["swept"] and fast_cap["best_scale"] == 2
    assert fast_cap["best_offered_rps"] == pytest.approx(2 * fast_cap["scales"][0]["offered_rps"])
    assert slow_cap["best_scale"] is None and "every time scale" in slow_cap["note"]
    assert res["schedule"]["identical"]
    assert 'id="fig-ab-capacity"' in (tmp_path / "run" / "report.html").read_text()


# --- bad input: one line, exit code 2, nothing left running -----------------------------------------------------

def _bad(args: list[str], capsys) -> str:
    rc = main(["bench", "ab", *args, "--trace", "conv", "--window", "busiest:2", "--tokenizer", "approx",
               "--health-timeout", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_bad_arms_are_refused_in_one_line(capsys, tmp_path):
    assert "at least two arms" in _bad(["--arm", "a=http://127.0.0.1:9"], capsys)
    assert "two arms are named 'a'" in _bad(["--arm", "a=http://127.0.0.1:9", "--arm", "a=http://127.0.0.1:9"],
                                            capsys)
    assert "{port}" in _bad(["--arm", "a=http://127.0.0.1:9", "--arm", f"b=cmd:{sys.executable} -V"], capsys)
    assert "no --arm defines" in _bad(["--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9",
                                       "--replicas", "c=2"], capsys)
    t0 = time.monotonic()
    err = _bad(["--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9"], capsys)
    assert "arm 'a': http://127.0.0.1:9 is unreachable" in err and time.monotonic() - t0 < 10


def test_a_command_that_never_gets_healthy_is_stopped_and_named(capsys, tmp_path):
    pid_file = tmp_path / "pid"
    sleeper = (f"{sys.executable} -c \"import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
               f"print('loading', flush=True); time.sleep(60)\" {pid_file} {{port}}")
    with FakeServerProcess(FakeScript(max_lifetime=60)) as srv:
        err = _bad(["--arm", f"stuck=cmd:{sleeper}", "--arm", f"ok={srv.url}", "--output-dir",
                    str(tmp_path / "run")], capsys)
        assert "arm 'stuck': its command did not become healthy within 1 s" in err and "loading" in err
        assert not alive(int(pid_file.read_text()))
        err = _bad(["--arm", f"dies=cmd:{sys.executable} -c \"raise SystemExit(3)\" {{port}}", "--arm",
                    f"ok={srv.url}", "--output-dir", str(tmp_path / "run2")], capsys)
        assert "arm 'dies': its command exited with status 3 before it became healthy" in err


def test_the_pieces(tmp_path):
    # replica-seconds: every series of the gateway counter summed; none when the page has none
    page = ('# TYPE tailguard_gateway_replica_seconds counter\n'
            'tailguard_gateway_replica_seconds_total{model="m",source="static"} 12.5\n'
            'tailguard_gateway_replica_seconds_total{model="m",source="provider"} 7.5\n'
            'tailguard_gateway_replica_seconds_created{model="m",source="static"} 1.7e9\n')
    assert parse_replica_seconds(page) == 20.0 and parse_replica_seconds("up 1\n") is None
    # the busiest window of a trace is where its arrivals crowd
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{t},10,5\n" for t in (0, 5, 10, 10.2, 10.4, 10.6, 30)))
    assert busiest_window(str(trace), 1.0) == (10.0, 4)
    # per-arm keys, credential headers and a command's secrets stay off the recorded command line
    line = command_line(["tailguard", "bench", "ab", "--arm", "a=http://u:pw1234@h:1", "--arm-key", "a=sk-secret-1",
                         "--arm-header=b=X-Api-Key:sk-secret-2",
                         "--arm", "b=cmd:serve --port {port} --api-key sk-secret-3"])
    assert "sk-secret" not in line and "pw1234" not in line and "--port" in line
