"""Export and history: Prometheus rules checked and unit-tested by promtool, the weekly report read from a store
we fill, and the store's alerts table (migrated from schema 1 to the current one)."""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import sqlite3
import subprocess

import numpy as np
import pytest
import yaml

from tailguard.cli import main
from tailguard.observe import store as store_mod
from tailguard.observe.store import SCHEMA_VERSION
from tailguard.observe.stores import open_store
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.slo.profiles import builtin_profiles
from tailguard.slo.report import build_report

PROMTOOL = shutil.which("promtool")


def _rules(tmp_path, custom: bool) -> tuple[str, str]:
    d = tmp_path / ("custom" if custom else "default")
    d.mkdir()
    args = ["slo", "rules", "-o", str(d / "rules.yml"), "--tests-output", str(d / "tests.yml")]
    if custom:
        (d / "slo.yaml").write_text(
            "slo:\n  tiers: {yellow: 1.5, orange: 2.0, red: 3.0, clear_ratio: 0.8}\n"
            "  golden_rules: {p99_over_p50: 4, p99_over_p95: 2}\n")
        (d / "p.yaml").write_text(
            "profiles:\n  api:\n    applies_to: {business_types: [api]}\n    objectives:\n"
            "      - {metric: ttft, percentile: 99, threshold: 350ms}\n      - {metric: error_rate, threshold: 1%}\n")
        args += ["--config", str(d / "slo.yaml"), "--file", str(d / "p.yaml"), "--profile", "baseline",
                 "--profile", "api"]
    assert main(args) == 0
    doc = yaml.safe_load((d / "rules.yml").read_text())
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    # custom: the one-metric shorthand (E2E); default: TTFT or TPOT
    yellow = "e2e_latency_seconds:p99_5m > 1.5\n" if custom else "ttft_seconds:p99_5m > 1.8 or"
    assert yellow in alerts["TailguardLatencyYellow"]["expr"]
    red_held = "> 2.4 and on()" if custom else "ttft_seconds:p99_5m > 2.7 or"  # hysteresis
    assert red_held in alerts["TailguardLatencyRed"]["expr"]
    burn = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "TailguardErrorBudgetBurn"]
    assert {r["labels"]["burn_factor"] for r in burn} == {"14.4", "6", "3", "1"}
    if custom:
        assert any('business_type=~"api"' in r["expr"] for g in doc["groups"] for r in g["rules"])
    return str(d / "rules.yml"), str(d / "tests.yml")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus')")
def test_promtool_checks_and_tests_the_exported_rules(tmp_path):
    """The default export and one with custom tiers, golden ratios and a custom profile."""
    files = [_rules(tmp_path, False), _rules(tmp_path, True)]
    # promtool's unit tests take seconds each: run the four checks side by side.
    procs = [subprocess.Popen([PROMTOOL, "check", "rules", r], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r, _ in files]
    procs += [subprocess.Popen([PROMTOOL, "test", "rules", t], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for _, t in files]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()


def _timeline(i: int, at: float, e2e: float, outcome: Outcome = Outcome.SUCCESS, bt: str = "chat") -> Timeline:
    tl = Timeline(request_id=f"r{i}", endpoint="/v1/chat/completions", received=0.0, received_unix=at,
                  business_type=bt)
    tl.tokenized, tl.scheduled, tl.first_token, tl.last_token = 0.001, 0.002, min(0.05, e2e), e2e
    tl.token_times = [min(0.05, e2e)]
    tl.num_prompt_tokens, tl.num_output_tokens = 20, 1
    tl.finalize(200 if outcome is Outcome.SUCCESS else 500, outcome, at=e2e)
    return tl


def test_report_reads_a_filled_store(tmp_path, capsys):
    monday = dt.datetime(2026, 11, 30, tzinfo=dt.UTC).timestamp()  # a Monday
    now = monday + 2.5 * 86400
    rng = np.random.default_rng(3)
    db = tmp_path / "requests.sqlite3"
    store = open_store(db, retention_days=36500)
    weeks = {"last": (monday - 7 * 86400, 7 * 86400, 0.5), "this": (monday, 2.5 * 86400 - 60, 0.9)}
    exact = {}
    i = 0
    for name, (start, span, sigma) in weeks.items():
        vals = rng.lognormal(np.log(0.4), sigma, 3000)
        exact[name] = vals
        for v, t in zip(vals, np.sort(rng.uniform(start, start + span, vals.size)), strict=True):
            store.put(_timeline(i, float(t), float(v)))
            i += 1
        for _ in range(30):
            store.put(_timeline(i, start + 3600, 0.1, Outcome.ERROR))
            i += 1
    store.put_alert({"id": "a1", "kind": "alert", "name": "tier_red", "event": "raised", "scope": "all",
                     "tier": "red", "at": monday + 3600, "started_at": monday + 3600, "figures": {"tier_value": 3.2},
                     "details": {}, "dry_run": False})
    store.close()

    rep = build_report(db, list(builtin_profiles().values()), weeks=2, now=now)
    assert rep["weeks"] == ["2026-W48", "2026-W49"]
    last, this = rep["trend"]
    for row, name in ((last, "last"), (this, "this")):
        v = exact[name]
        assert row["requests"] == 3030 and row["error_rate"] == pytest.approx(30 / 3030)
        for q in (0.5, 0.95, 0.99):
            assert row[f"p{int(q * 100)}"] == pytest.approx(np.quantile(v, q), rel=0.02)
        assert row["p99_over_p95"] == pytest.approx(np.quantile(v, 0.99) / np.quantile(v, 0.95), rel=0.03)
    assert this["ratio_change"] > 0  # the heavier tail this week
    assert this["alerts"] == {"red": 1} and last["alerts"] is None
    p99 = next(r for r in rep["attainment"] if r["profile"] == "baseline" and r["objective"] == "e2e_p99")
    cell = p99["weeks"]["2026-W49"]
    assert cell["met"] == bool(np.quantile(exact["this"], 0.99) <= 2.0)
    assert cell["good_share"] == pytest.approx((exact["this"] <= 2.0).mean(), abs=1e-9)

    # The command line: JSON and the tables (weeks counted back from today, so only the shape is checked).
    assert main(["slo", "report", "--db", str(db), "--json", "--weeks", "2"]) == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"trend", "attainment", "weeks"}
    assert main(["slo", "report", "--db", str(db)]) == 0
    assert "Weekly tail trend" in capsys.readouterr().out
    assert main(["slo", "report", "--db", str(tmp_path / "none.sqlite3")]) == 2
    assert "no such request store" in capsys.readouterr().err


def test_store_migrates_schema_1_and_keeps_alerts(tmp_path):
    db = tmp_path / "old.sqlite3"
    # Schema 1: today's requests table without the columns version 2 added, and no slo_alerts table.
    v1 = store_mod.SQLITE_SCHEMA.split("CREATE TABLE IF NOT EXISTS slo_alerts")[0]
    v1 = re.sub(r",\s*lane TEXT,.*?\n\);", "\n);", re.sub(r"--[^\n]*", "", v1), flags=re.S)
    assert "slo_action" not in v1 and "lane" not in v1
    conn = sqlite3.connect(db)
    conn.executescript(v1)
    conn.execute("INSERT INTO requests (request_id, received_at, endpoint, stream, status, outcome, prompt_tokens, "
                 "output_tokens, e2e, tokenize, queue, prefill, decode, stream_time, record) "
                 "VALUES ('old', 1, '/v1/completions', 0, 200, 'success', 1, 1, 0.5, 0, 0, 0, 0.5, 0, '{}')")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    store = open_store(db, retention_days=36500)
    try:
        assert store.schema_version == SCHEMA_VERSION  # migrated all the way up
        old = store.get("old")
        assert old["degraded"] is False and old["lane"] == "default" and old["slo_action"] is None
        rec = {"id": "x", "kind": "action", "name": "shed", "event": "started", "scope": "all", "tier": "orange",
               "at": 10.0, "started_at": 10.0, "ended_at": None, "figures": {"tier_value": 2.6, "samples": 80},
               "details": {"status": 429}, "dry_run": False, "alert_id": "a"}
        store.put_alert(rec)
        assert store.flush()
        assert store.alerts() == [rec]
    finally:
        store.close()
