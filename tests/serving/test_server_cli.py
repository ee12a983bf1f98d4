"""``tailguard serve`` as a user runs it: a subprocess on loopback, configured by a YAML file and flags."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import httpx
import openai
import pytest

from tests.serving_helpers import start_serve, stop_serve


def test_serve_fake_subprocess(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("model: fake\nmax_queue: 7\nfake:\n  ttft: 0.01\n  itl: 0.001\nbusiness_types: [vip]\n")
    key = "sk-cli-secret-0042"
    proc, url = start_serve("--config", str(cfg), "--store", str(tmp_path / "store.sqlite3"), "--api-key", key)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
        r = client.chat.completions.with_raw_response.create(
            model="fake", messages=[{"role": "user", "content": "你好"}], max_tokens=4,
            extra_headers={"X-Business-Type": "vip"})
        assert r.parse().choices[0].message.content == "The "
        metrics = httpx.get(url + "/metrics").text
        assert 'tailguard_server_queue_capacity{model="fake"} 7.0' in metrics
        assert 'business_type="vip"' in metrics
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        out = stop_serve(proc)
    assert key not in out
    # Shut down cleanly: the batch writer flushed the record before the process ended.
    conn = sqlite3.connect(tmp_path / "store.sqlite3")
    rows = conn.execute("SELECT business_type, outcome FROM requests").fetchall()
    conn.close()
    assert rows == [("vip", "success")]


def test_serve_rejects_bad_config(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: fake\nmax_queue: -3\n")
    out = subprocess.run([sys.executable, "-m", "tailguard.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "max_queue" in out.stderr


@pytest.mark.parametrize("interval", [0.6, 0])
def test_sampling_interval_is_bounded(interval):
    from pydantic import ValidationError

    from tailguard.serving.config import ServerConfig

    with pytest.raises(ValidationError):
        ServerConfig(sample_interval=interval)


def test_a_store_that_cannot_be_opened_is_one_line_before_the_server_starts(tmp_path):
    corrupt = tmp_path / "corrupt.sqlite3"
    corrupt.write_text("not a database")
    for store, why in ((tmp_path, "unable to open"), (corrupt, "not a database")):
        out = subprocess.run([sys.executable, "-m", "tailguard.cli", "serve", "--model", "fake", "--port", "0",
                              "--store", str(store)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("tailguard serve: cannot open the request store") and why in last
        assert "Traceback" not in out.stderr
