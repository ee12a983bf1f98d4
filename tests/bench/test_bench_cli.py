"""``tailguard bench`` end to end: the fake-server command, a run writing its three outputs, sweep, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.cli import main

TAILGUARD = [sys.executable, "-m", "tailguard.cli"]


@pytest.fixture(scope="module")
def fake_cli_server():
    """``tailguard bench fake-server --port 0``, started the way a user would."""
    proc = subprocess.Popen([*TAILGUARD, "bench", "fake-server", "--port", "0", "--ttft", "0.01", "--itl", "0.002",
                             "--multi-token-every", "4", "--max-lifetime", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("fake OpenAI-compatible server on http://127.0.0.1:"), line + proc.stderr.read()
    url = line.split(" on ", 1)[1].split()[0]
    yield url
    proc.terminate()
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


def test_cli_run_writes_results_csv_and_report(fake_cli_server, tmp_path):
    out = tmp_path / "run"
    # --model is left out: the bench asks /v1/models
    p = subprocess.run([*TAILGUARD, "bench", "--url", fake_cli_server, "--rate", "50", "--num-requests", "40",
                        "--input-tokens", "32", "--output-tokens", "8", "--langs", "en,zh", "--warmup-requests", "4",
                        "--tokenizer", "approx", "--bootstrap", "200", "--seed", "3", "--output-dir", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    for name in ("TTFT", "ITL", "TPOT", "E2E", "SLO verdicts", "req/s", "report.html"):
        assert name in p.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["run"]["target"]["model"] == "fake" and res["run"]["seed"] == 3
    assert res["summary"]["requests"]["measured"] == 36 and res["summary"]["requests"]["warmup"] == 4
    assert res["run"]["load"]["arrival"] == "poisson" and res["run"]["load"]["rate"] == 50
    assert res["tokens"]["chunks"]["multi_token"] > 0
    assert (out / "requests.csv").read_text().count("\n") == 41
    assert 'id="fig-sankey"' in (out / "report.html").read_text()


def test_cli_quiet_closed_loop_prints_only_the_report_path(fake_cli_server, tmp_path, capsys):
    rc = main(["bench", "--url", fake_cli_server + "/v1/chat/completions", "--model", "fake", "--concurrency", "3",
               "--num-requests", "12", "--output-tokens", "4", "--endpoint", "completions", "--tokenizer", "approx",
               "--bootstrap", "0", "--quiet", "--output-dir", str(tmp_path)])
    assert rc == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "report.html")
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["run"]["target"]["endpoint"] == "/v1/completions" and res["run"]["load"]["concurrency"] == 3


def test_cli_sweep_finds_the_highest_passing_rate(tmp_path, capsys):
    profile = tmp_path / "tight.yaml"
    # the fake server never saturates (every request gets its scripted 90 ms), so every step passes
    profile.write_text("name: tight\nobjectives:\n  - {metric: e2e, percentile: 99, threshold: 150ms}\n")
    with FakeServerProcess(FakeScript(ttft=0.02, itl=0.01, max_lifetime=120)) as srv:
        rc = main(["bench", "sweep", "--url", srv.url, "--model", "fake", "--profile", str(profile),
                   "--profiles", "baseline", "--start-rate", "10", "--max-rate", "40", "--num-requests", "30",
                   "--output-tokens", "8", "--tokenizer", "approx", "--bootstrap", "100", "--refine", "0",
                   "--output-dir", str(tmp_path / "sw")])
    assert rc == 0
    res = json.loads((tmp_path / "sw" / "results.json").read_text())
    sw = res["sweep"]
    assert sw["profile"] == "tight" and [s["rate"] for s in sw["steps"]] == [10.0, 20.0, 40.0]
    assert sw["best_rate"] == 40.0 and all(s["pass"] for s in sw["steps"])
    assert 'id="fig-sweep"' in (tmp_path / "sw" / "report.html").read_text()
    assert "rate    40.00 req/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--rate", "10"], "--url is required"),
    (["--url", "ftp://x"], "must be an http(s) URL"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--rate", "-3"], "--rate must be positive"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "0"], "--num-requests must be at least 1"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--langs", "en,fr"], "--langs takes a comma list"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--workload", "jsonl"], "needs --jsonl PATH"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--trace", "nope.csv"], "neither a built-in trace"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--profiles", "gold"], "unknown SLO profile"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--header", "novalue"], "NAME:VALUE"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "1", "--tokenizer", "approx"],
     "did not answer the probe"),
    (["--url", "http://127.0.0.1:9", "--num-requests", "1"], "/v1/models could not be read"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--rate", "nan"], "--rate must be a number"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--burstiness", "nan"], "--burstiness must be a number"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--warmup-seconds", "nan"], "--warmup-seconds must be a number"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--temperature", "nan"], "--temperature must be a number"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--temperature", "-1"], "--temperature must be from 0 to 2"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--rate", "inf"], "--rate must be finite"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--rate", "1e-300"], "--rate must be at least 0.001"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_bad_jsonl_and_profile_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    with FakeServerProcess(FakeScript(ttft=0.001, itl=0.001, max_lifetime=60)) as srv:
        for second, message in (('{"nothing": 1}', "bad.jsonl:2: needs 'prompt' or 'messages'"),
                                ("[1, 2]", "bad.jsonl:2: a request is a JSON object, not list"),
                                ("null", "bad.jsonl:2: a request is a JSON object, not NoneType"),
                                ('{"prompt": "x", "max_tokens": [4]}', "bad.jsonl:2: 'max_tokens' must be a positive")):
            bad.write_text('{"prompt": "hi"}\n' + second + "\n")
            assert main(["bench", "--url", srv.url, "--model", "fake", "--jsonl", str(bad), "--tokenizer",
                         "approx"]) == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err
    yml = tmp_path / "p.yaml"
    yml.write_text("name: x\nobjectives:\n  - {metric: latency, percentile: 99, threshold: 1s}\n")
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--profiles-file", str(yml)]) == 2
    assert "objective metric must be one of" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--profiles-file",
                 str(Path(tmp_path, "none.yaml"))]) == 2


API_KEY = "sk-test-Zq81secretKEY"
HEADER_SECRET = "hdr-tok-77secretVALUE"


def test_no_secret_in_any_output(fake_cli_server, tmp_path, capsys, monkeypatch):
    argv = ["bench", "--url", fake_cli_server, "--model", "fake", "--api-key", API_KEY,
            f"--header=X-Auth-Token: {HEADER_SECRET}", "--header", "X-Business-Type: mobile", "--concurrency", "2",
            "--num-requests", "6", "--output-tokens", "4", "--tokenizer", "approx", "--bootstrap", "50",
            "--output-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["tailguard", *argv])  # what the recorded command is read from
    assert main(argv) == 0
    out, err = capsys.readouterr()
    files = {name: (tmp_path / name).read_text(encoding="utf-8")
             for name in ("results.json", "requests.csv", "report.html")}
    for where, text in {**files, "stdout": out, "stderr": err}.items():
        assert API_KEY not in text and HEADER_SECRET not in text, where
    cmd = json.loads(files["results.json"])["run"]["command"]
    # the command can still be read and repeated: only the credentials are masked
    assert "--api-key '***'" in cmd and "'--header=X-Auth-Token:***'" in cmd
    assert "'X-Business-Type: mobile'" in cmd and "--concurrency 2" in cmd


def test_a_secret_echoed_by_the_server_is_scrubbed(tmp_path):
    import asyncio

    from tailguard.bench.runner import execute, write_outputs
    from tests.bench_helpers import ScriptedTransport, bench_config

    tr = ScriptedTransport(FakeScript(), fail=lambda i: "429" if i % 2 else None)
    cfg = bench_config(concurrency=2, num_requests=8, api_key=API_KEY)
    res, ms = asyncio.run(execute(cfg, transport=tr, display=False))
    assert res["summary"]["requests"]["failed"] == 4
    write_outputs(res, ms, tmp_path)
    for name in ("results.json", "requests.csv", "report.html"):
        text = (tmp_path / name).read_text(encoding="utf-8")
        assert API_KEY not in text, name
    assert "too many requests for Bearer ***" in (tmp_path / "requests.csv").read_text(encoding="utf-8")


def test_redaction_of_urls_and_command_lines():
    from tailguard.bench.redact import redact_argv, redact_url

    assert redact_url("http://user:pw@h:8000/v1?api_key=abc&a=1") == "http://***@h:8000/v1?api_key=***&a=1"
    assert redact_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert redact_argv(["--api-key=k1", "--api-key", "k2", "--header", "Authorization: Bearer k3", "--header",
                        "X-Lane: core", "--url", "https://u:p@x"]) == [
        "--api-key=***", "--api-key", "***", "--header", "Authorization:***", "--header", "X-Lane: core", "--url",
        "https://***@x"]
