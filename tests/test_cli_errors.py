"""Bad input to ``tailguard serve``, ``keys``, ``generate``, ``rebuild`` and ``demo``: one line on stderr and exit 2,
never a traceback, a hang, a secret echoed, or a server that starts open or answers 503 for ever.

The commands run as subprocesses with a timeout, as a user runs them: a command that would start a server or spin
instead of refusing fails the test by its timeout rather than hanging the suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailguard.cli import build_parser, main
from tailguard.policy.lanes import LaneConfig
from tailguard.policy.tenants import KeyFile
from tailguard.serving.config import ServerConfig

SECRET_CFG = "api_key: sk-SUPERSECRET123\nadmin_key: ADMINSECRET\n"


def run_cli(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tailguard.cli", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def assert_one_line_error(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    nokeys = tmp_path / "nokeys.yaml"
    nokeys.write_text("tenants: {acme: {lane: standard}}\nkeys: []\n")
    secret = tmp_path / "cfg.yaml"
    secret.write_text(SECRET_CFG)
    ghost = tmp_path / "ghost.yaml"
    kf = KeyFile()
    kf.add_key("t1", "ghost")
    kf.save(ghost)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("port: [\n")
    empty = tmp_path / "empty.key"
    empty.write_text("")
    malformed = tmp_path / "bad.key"
    malformed.write_text("not-a-fernet-key\n")
    engine0 = tmp_path / "engine0.yaml"
    engine0.write_text("model: tiny\nengine: {max_num_seqs: 0}\n")
    return {"nokeys": str(nokeys), "secret": str(secret), "ghost": str(ghost), "bad_yaml": str(bad_yaml),
            "empty": str(empty), "malformed": str(malformed), "dir": str(tmp_path), "engine0": str(engine0),
            "store": str(tmp_path / "store.sqlite3"), "tmp": str(tmp_path)}


# --- serve -----------------------------------------------------------------------------------------------------------
SERVE_CASES = [
    (["--model", "fake", "--keys", "{tmp}/typo-keys.yaml"], ["no such key file"]),
    (["--model", "fake", "--keys", "{nokeys}"], ["holds no keys"]),
    (["--model", "fake", "--keys", "{secret}"], ["not a key file"]),
    (["--model", "fake", "--keys", "{ghost}"], ["'t1'", "'ghost'"]),
    (["--model", "fake", "--seal-key-file", "{tmp}/nonexistent.key"], ["sealing key"]),
    (["--model", "fake", "--seal-key-file", "{dir}"], ["sealing key"]),
    (["--model", "fake", "--seal-key-file", "{empty}"], ["empty"]),
    (["--model", "fake", "--seal-key-file", "{malformed}"], ["sealing key"]),
    (["--config", "{bad_yaml}"], ["not valid YAML at line"]),
    (["--model", "/nonexistent.gguf"], ["/nonexistent.gguf"]),
    (["--model", "bogus"], ["'bogus'", "tiny", "fake"]),
    (["--model", "tiny", "--kv-cache-memory", "banana"], ["--kv-cache-memory"]),
    (["--model", "tiny", "--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--model", "tiny", "--block-size", "0"], ["--block-size"]),
    (["--config", "{engine0}"], ["max-num-seqs"]),
]


@pytest.mark.parametrize(("args", "needles"), SERVE_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_serve_refuses_bad_input_before_starting(files, args, needles):
    out = run_cli("serve", "--port", "0", "--store", files["store"], *[a.format(**files) for a in args])
    line = assert_one_line_error(out, "tailguard serve:", *needles)
    assert "SUPERSECRET" not in out.stderr + out.stdout and "ADMINSECRET" not in line


def test_serve_refuses_a_malformed_seal_key_in_the_environment(files):
    out = run_cli("serve", "--model", "fake", "--port", "0", "--store", files["store"],
                  env={"TAILGUARD_SEAL_KEY": "garbage"})
    assert "garbage" not in assert_one_line_error(out, "TAILGUARD_SEAL_KEY")


def test_a_tenant_in_a_lane_the_config_declares_is_accepted(files):
    from tailguard.cli import _serve_problem

    lanes = {"ghost": LaneConfig(), "standard": LaneConfig()}
    ok = ServerConfig(model="fake", keys_file=files["ghost"], lanes=lanes, store_path=files["store"])
    assert _serve_problem(ok) is None
    default = ServerConfig(model="fake", keys_file=files["ghost"], store_path=files["store"])
    assert "'ghost'" in (_serve_problem(default) or "")


def test_ctrl_c_on_serve_exits_130_without_a_traceback(tmp_path):
    err_path = tmp_path / "serve.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--model", "fake", "--port", "0",
                                 "--store", str(tmp_path / "s.sqlite3")], stdout=subprocess.DEVNULL, stderr=err,
                                stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 30
            while "Application startup complete" not in err_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = err_path.read_text()
    assert rc == 130 and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-2000:]


# --- keys ------------------------------------------------------------------------------------------------------------
def test_keys_list_of_a_settings_file_echoes_no_secret(files):
    out = run_cli("keys", "list", "--file", files["secret"])
    assert_one_line_error(out, "tailguard keys:", "not a key file")
    assert "SUPERSECRET" not in out.stderr + out.stdout and "ADMINSECRET" not in out.stderr + out.stdout


def test_keys_list_of_another_kind_of_file_echoes_none_of_its_lines(tmp_path):
    other = tmp_path / "shadow"
    other.write_text("root:$6$SECRETHASH:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n")
    out = run_cli("keys", "list", "--file", str(other))
    assert "SECRETHASH" not in assert_one_line_error(out, "tailguard keys:")


@pytest.mark.parametrize("args", [
    ["add", "--file", "{bad_yaml}", "--tenant", "a"],
    ["list", "--file", "{bad_yaml}"],
    ["list", "--file", "{tmp}/missing.yaml"],
    ["add", "--file", "{tmp}/k.yaml", "--tenant", "a", "--requests-per-s", "-1"],
    ["add", "--file", "{tmp}/k.yaml", "--tenant", "a", "--requests-per-s", "nan"],
    ["add", "--file", "{tmp}/k.yaml", "--tenant", "a", "--tokens-per-s", "-1"],
    ["add", "--file", "{secret}/sub.yaml", "--tenant", "a"],
], ids=lambda v: " ".join(v))
def test_keys_refuses_bad_input_in_one_line(files, args):
    out = run_cli("keys", *[a.format(**files) for a in args])
    assert_one_line_error(out, "tailguard keys:")
    assert out.stdout == ""  # no key printed for a key that was not kept
    assert not Path(files["tmp"], "k.yaml").exists()


def test_keys_add_warns_of_a_lane_that_is_not_a_default_lane(tmp_path, capsys):
    assert main(["keys", "add", "--file", str(tmp_path / "k.yaml"), "--tenant", "t1", "--lane", "ghost"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "'ghost'" in err and "lanes:" in err
    assert main(["keys", "add", "--file", str(tmp_path / "k.yaml"), "--tenant", "t2", "--lane", "vip"]) == 0
    assert "warning" not in capsys.readouterr().err


# --- generate, rebuild, demo -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "needle"), [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "-1"], "--max-tokens"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (["--model", "bogus"], "tiny"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-cache-memory", "banana"], "--kv-cache-memory"),
    (["--kv-cache-tokens", "-5"], "--kv-cache-tokens"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_generate_refuses_bad_input_in_one_line(args, needle):
    out = run_cli("generate", "hi", "--model", "tiny", *args)
    assert_one_line_error(out, "tailguard generate:", needle)


def test_rebuild_refuses_an_engine_limit_below_one(tmp_path):
    out = run_cli("rebuild", "some-id", "--store", str(tmp_path / "s.sqlite3"), "--model", "tiny",
                  "--max-num-seqs", "0")
    assert_one_line_error(out, "tailguard rebuild:", "--max-num-seqs")


@pytest.mark.parametrize(("args", "needle"), [
    (["--requests", "0"], "--requests"),
    (["--requests", "-1"], "--requests"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--bench-rate", "nan"], "--bench-rate"),
    (["--output-dir", "/proc/demo"], "/proc/demo"),
    (["--model", "/nonexistent.gguf"], "/nonexistent.gguf"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_demo_refuses_bad_input_before_loading_the_model(tmp_path, args, needle):
    out = run_cli("demo", "--model", "tiny", "--output-dir", str(tmp_path / "demo"), *args)
    assert_one_line_error(out, "tailguard demo:", needle)
    assert not (tmp_path / "demo").exists() or "--output-dir" in args


# --- help ------------------------------------------------------------------------------------------------------------
def _model_help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a.help for a in sub._actions if "--model" in a.option_strings)


def test_model_help_says_what_each_command_accepts():
    assert "fake" in _model_help("serve") and "tiny" in _model_help("serve")
    for command in ("demo", "generate"):
        assert "fake" not in _model_help(command) and "tiny" in _model_help(command)
