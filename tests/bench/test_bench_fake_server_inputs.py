"""``tailguard bench fake-server``: a bad --max-lifetime or an unopenable --received-log is one line and exit 2,
the log's own error (not a misleading "cannot listen"), before any port is bound."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tailguard.cli import main


@pytest.mark.parametrize("value,says", [
    ("nan", "--max-lifetime must be a number"),
    ("0", "--max-lifetime must be positive"),
])
def test_max_lifetime_is_validated(capsys, value, says):
    assert main(["bench", "fake-server", "--port", "0", "--max-lifetime", value]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("value,says", [("inf", "--max-lifetime must be finite"),
                                        ("1e300", "--max-lifetime must be at most")])
def test_an_endless_max_lifetime_is_refused(value, says):
    # in a child process with a timeout: were it accepted, the server would never exit
    r = subprocess.run([sys.executable, "-m", "tailguard.cli", "bench", "fake-server", "--port", "0",
                        "--max-lifetime", value], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("log", ["/nonexistent/dir/x.log", "DIR"])
def test_an_unopenable_received_log_names_the_log_not_the_port(capsys, tmp_path, log):
    log = str(tmp_path) if log == "DIR" else log
    assert main(["bench", "fake-server", "--port", "0", "--max-lifetime", "2", "--received-log", log]) == 2
    out = capsys.readouterr()
    assert f"cannot open the --received-log file {log}" in out.err and "cannot listen" not in out.err
    assert "fake OpenAI-compatible server on" not in out.out  # it never listened
