"""``tailguard slo ...`` refuses bad flag values and unwritable outputs with one line and exit 2: no traceback, no
report built on nonsense (zero samples, zero weeks, a NaN sigma), no text injected into PromQL, no password shown."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tailguard.cli import main


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A tiny SQLite request store: enough columns for the report and hotspots, no rows."""
    path = tmp_path / "s.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE requests (id INTEGER PRIMARY KEY, request_id TEXT, received_at REAL, e2e REAL, "
                     "outcome TEXT)")
    conn.close()
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["slo", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


# --- slo report -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--min-samples", "0"], "--min-samples must be at least 1"),
    (["--min-samples", "-1"], "--min-samples must be at least 1"),
    (["--weeks", "0"], "--weeks must be 1 to 520"),
    (["--weeks", "-2"], "--weeks must be 1 to 520"),
    (["--json", "--weeks", "0"], "--weeks must be 1 to 520"),
    (["--weeks", "100000000"], "--weeks must be 1 to 520"),
])
def test_report_rejects_bad_weeks_and_min_samples(capsys, store, flags, says):
    rc, out, err = _run(capsys, "report", "--db", store, *flags)
    assert rc == 2 and says in err and out == ""


def test_report_still_runs_with_good_values(capsys, store):
    rc, out, _ = _run(capsys, "report", "--db", store, "--weeks", "1", "--min-samples", "1", "--json")
    assert rc == 0 and '"weeks"' in out


def test_report_on_a_file_that_is_not_a_database_is_one_line(capsys, tmp_path):
    bogus = tmp_path / "config.yaml"
    bogus.write_text("server:\n  port: 8000\n" * 50)
    rc, _, err = _run(capsys, "report", "--db", str(bogus))
    assert rc == 2 and err.startswith("error: ") and "not a database" in err and len(err.splitlines()) == 1


def test_report_on_a_postgresql_url_says_sqlite_only_and_hides_the_password(capsys):
    rc, _, err = _run(capsys, "report", "--db", "postgresql://tg:PGSECRETPW@127.0.0.1:18559/tgdb")
    assert rc == 2 and "SQLite" in err and "PostgreSQL" in err
    assert "PGSECRETPW" not in err and "postgresql://tg:***@127.0.0.1:18559/tgdb" in err


def test_report_reads_a_sqlite_url(capsys, store):
    rc, _, _ = _run(capsys, "report", "--db", "sqlite://" + store, "--json")
    assert rc == 0


def test_report_html_that_cannot_be_written_fails_before_the_report(capsys, store, tmp_path):
    for target in ("/proc/x.html", str(tmp_path)):
        rc, out, err = _run(capsys, "report", "--db", store, "--html", target)
        assert rc == 2 and f"error: cannot write {target}" in err and out == ""


# --- slo rules / grafana outputs --------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["rules", "grafana"])
@pytest.mark.parametrize("target", ["/proc/x.yaml", "DIR"])
def test_an_unwritable_output_is_one_line(capsys, tmp_path, cmd, target):
    target = str(tmp_path) if target == "DIR" else target
    rc, _, err = _run(capsys, cmd, "--output", target)
    assert rc == 2 and f"error: cannot write {target}" in err


def test_an_unwritable_tests_output_fails_before_the_rules_file_is_written(capsys, tmp_path):
    rules = tmp_path / "rules.yaml"
    rc, _, err = _run(capsys, "rules", "--output", str(rules), "--tests-output", "/proc/t.yaml")
    assert rc == 2 and "error: cannot write /proc/t.yaml" in err and not rules.exists()


def test_tests_output_without_output_writes_nothing_to_stdout(capsys, tmp_path):
    rc, out, err = _run(capsys, "rules", "--tests-output", str(tmp_path / "t.yaml"))
    assert rc == 2 and out == "" and "--tests-output needs --output" in err


# --- slo rules --tier-window ------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", ["bogus", "5m]) or vector(1", "5", "0m", "-5m", "5 m", ""])
def test_tier_window_must_be_a_prometheus_duration(capsys, tmp_path, window):
    rules = tmp_path / "rules.yaml"
    rc, out, err = _run(capsys, "rules", "--output", str(rules), f"--tier-window={window}")
    assert rc == 2 and "--tier-window takes a Prometheus duration" in err and not rules.exists() and out == ""


@pytest.mark.parametrize("window", ["30s", "5m", "1h30m", "500ms", "1d"])
def test_tier_window_takes_valid_durations(capsys, tmp_path, window):
    rules = tmp_path / "rules.yaml"
    rc, _, _ = _run(capsys, "rules", "--output", str(rules), "--tier-window", window)
    assert rc == 0 and f"_bucket[{window}]" in rules.read_text()


# --- slo hotspots ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--top", "-1"], "--top must be at least 1"),
    (["--top", "0"], "--top must be at least 1"),
    (["--limit", "-1"], "--limit must be at least 1"),
    (["--sigma", "nan"], "--sigma must be a finite number"),
    (["--sigma", "-1"], "--sigma must be a finite number above 0"),
    (["--sigma", "0"], "--sigma must be a finite number above 0"),
    (["--hours", "nan"], "--hours must be a finite number above 0"),
    (["--hours", "-1"], "--hours must be a finite number above 0"),
    (["--hours", "0"], "--hours must be a finite number above 0"),
])
def test_hotspots_bounds(capsys, store, flags, says):
    rc, out, err = _run(capsys, "hotspots", "--store", store, *flags)
    assert rc == 2 and says in err and out == ""


def test_hotspots_with_good_values_runs(capsys, store):
    rc, _, _ = _run(capsys, "hotspots", "--store", store, "--hours", "1", "--sigma", "1.5", "--top", "1", "--json")
    assert rc == 0
