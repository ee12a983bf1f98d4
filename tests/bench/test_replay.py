"""``tailguard replay``: a stored request sent again, to the same server and through the CLI, with the edit distance
to the original output and the stage timings side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tailguard.bench.replay import ReplayError, build_request, fetch_record, replay
from tailguard.observe.redaction import Redactor
from tests.serving_helpers import ADMIN, ADMIN_KEY, fake_server, settle, tiny_engine


@pytest.fixture(scope="module")
def redactor():
    return Redactor()


def test_replay_of_a_greedy_request_gives_the_same_output(tmp_path, redactor):
    with fake_server(tmp_path, engine=tiny_engine(), redactor=redactor, store_text=True) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "orig-1"}, timeout=60)
        assert r.status_code == 200
        settle(server)
        rec = fetch_record("orig-1", source=server.url, admin_key=ADMIN_KEY)
        assert rec["prompt_redacted"] is False
        res = replay(rec, server.url)
        d = res.to_dict()
        assert d["edit_distance"]["identical"] is True and d["edit_distance"]["words"] == 0
        assert res.text == r.json()["choices"][0]["message"]["content"]
        assert d["replay"]["output_tokens"] == 12 and set(d["replay"]["stages"]) >= {"queue", "prefill", "decode"}
        assert any("chat template" in n for n in res.notes)
        # The CLI, reading the record from the store file itself.
        out = subprocess.run([sys.executable, "-m", "tailguard.cli", "replay", "orig-1", "--url", server.url,
                              "--store", server.config.store_path, "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["edit_distance"]["words"] == 0


def test_replay_says_what_it_cannot_do(tmp_path, redactor):
    with fake_server(tmp_path) as server:  # no text storage
        r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-ID": "plain"},
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
        settle(server)
        rec = fetch_record("plain", source=server.url, admin_key=ADMIN_KEY)
        with pytest.raises(ReplayError, match="--store-text"):
            build_request(rec, "fake")
        with pytest.raises(ReplayError, match="404"):
            fetch_record("nope", source=server.url, admin_key=ADMIN_KEY)
        with pytest.raises(ReplayError, match="401"):
            fetch_record("plain", source=server.url, admin_key="wrong")
    with fake_server(tmp_path / "t", redactor=redactor, store_text=True) as server:
        r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-ID": "pii"},
                       json={"model": "fake", "messages": [{"role": "user", "content": "mail me at jo@example.com"}],
                             "max_tokens": 2})
        settle(server)
        rec = httpx.get(server.url + "/v1/requests/pii", headers=ADMIN).json()
        assert rec["prompt_redacted"] is True and "jo@example.com" not in rec["prompt_text"]
        _, body, notes = build_request(rec, "fake")
        assert "jo@example.com" not in body["prompt"] and any("redacted" in n for n in notes)


def test_replay_and_rebuild_fail_with_one_line_where_nothing_answers(tmp_path):
    """A store path that is not there, a server that does not answer: one line and exit 2 (replay) or 1 (rebuild),
    no traceback, and no new empty store left at the mistyped path."""
    from tailguard.observe.sealing import new_key

    missing = tmp_path / "typo" / "requests.sqlite3"
    key = tmp_path / "seal.key"
    key.write_text(new_key())
    runs = {
        "store": ["replay", "r1", "--store", str(missing), "--url", "http://127.0.0.1:9"],
        "source": ["replay", "r1", "--source", "http://u:SRCPW@127.0.0.1:9", "--url", "http://u:URLPW@127.0.0.1:9"],
        "rebuild": ["rebuild", "r1", "--store", str(missing), "--seal-key-file", str(key)],
    }
    for what, args in runs.items():
        out = subprocess.run([sys.executable, "-m", "tailguard.cli", *args], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == (1 if what == "rebuild" else 2), (what, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, (what, out.stderr)
        assert ("no request store" in out.stderr) if what != "source" else ("ConnectError" in out.stderr)
        assert "SRCPW" not in out.stderr and "URLPW" not in out.stderr  # a URL's password is never printed
    assert not (tmp_path / "typo").exists()
