"""The request store: WAL, schema version, exactly-once batch writes off the caller's thread, retention, text rules."""

from __future__ import annotations

import sqlite3
import time

import pytest

from tailguard.observe.store import SCHEMA_VERSION, RequestStore, SchemaError
from tailguard.observe.timeline import Outcome, Timeline


def _tl(i: int, age_days: float = 0.0, **kw) -> Timeline:
    tl = Timeline(request_id=f"req-{i}", endpoint="/v1/chat/completions", received=50.0,
                  received_unix=time.time() - age_days * 86400, tokenized=50.001, scheduled=50.002,
                  first_token=50.01, last_token=50.02, token_times=[50.01, 50.02], num_prompt_tokens=5,
                  num_output_tokens=2, finish_reason="length", **kw)
    tl.finalize(200, Outcome.SUCCESS, at=50.021)
    return tl


@pytest.fixture
def store(tmp_path):
    s = RequestStore(tmp_path / "r.sqlite3", flush_interval=0.01)
    yield s
    s.close()


def test_schema_and_wal(store, tmp_path):
    conn = sqlite3.connect(tmp_path / "r.sqlite3")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"requests", "queue_samples"} <= tables
    conn.close()


def test_every_record_written_exactly_once(store):
    t0 = time.perf_counter()
    for i in range(500):
        assert store.put(_tl(i))
    put_time = time.perf_counter() - t0
    assert store.flush(10)
    assert store.count() == 500
    assert store.written == 500 and store.failed == 0
    ids = {r[0] for r in store.query("SELECT request_id FROM requests")}
    assert ids == {f"req-{i}" for i in range(500)}
    # put() only appends to a queue (the records are built on the writer thread): far below 1 ms each.
    assert put_time / 500 < 1e-3
    rec = store.get("req-7")
    assert rec["outcome"] == "success" and rec["token_times"] == pytest.approx([0.01, 0.02])
    assert sum(rec["stages"].values()) == pytest.approx(rec["e2e"], abs=1e-9)
    assert "prompt_text" not in rec


def test_repeated_request_id_keeps_both_and_get_returns_latest(store):
    a, b = _tl(1), _tl(1)
    b.status = 201
    store.put(a)
    store.put(b)
    store.flush()
    assert store.count() == 2
    assert store.get("req-1")["status"] == 201


def test_retention(tmp_path):
    path = tmp_path / "r.sqlite3"
    s = RequestStore(path, retention_days=15, flush_interval=0.01)
    s.put(_tl(1, age_days=16))
    s.put(_tl(2, age_days=14))
    s.put_sample(time.time() - 20 * 86400, 1, 0, 0, 0, 10)
    s.flush()
    assert s.count() == 2
    assert s.enforce_retention() == 1
    assert [r[0] for r in s.query("SELECT request_id FROM requests")] == ["req-2"]
    assert s.query("SELECT COUNT(*) FROM queue_samples")[0][0] == 0
    s.put(_tl(3, age_days=30))
    s.close()
    # Opening the store sweeps at once.
    s2 = RequestStore(path, retention_days=15)
    s2.flush()
    deadline = time.monotonic() + 5
    while s2.count() != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r[0] for r in s2.query("SELECT request_id FROM requests")] == ["req-2"]
    s2.close()


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "r.sqlite3"
    RequestStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaError):
        RequestStore(path)


def test_text_needs_a_redactor(tmp_path):
    with pytest.raises(ValueError):
        RequestStore(tmp_path / "r.sqlite3", store_text=True)


def test_text_is_redacted_and_tokens_follow_the_redacted_text(tmp_path):
    def redact(text):
        return None if text is None else text.replace("secret", "<X>")

    def encode(text):
        return [ord(c) for c in text]

    s = RequestStore(tmp_path / "r.sqlite3", store_text=True, redact=redact, encode=encode, flush_interval=0.01)
    tl = _tl(1, prompt_text="my secret", output_text="no secret here", prompt_token_ids=[1, 2, 3],
             logprobs=[{"id": 5, "logprob": -0.1, "top": [[5, -0.1], [6, -2.0]]}])
    s.put(tl)
    s.put(_tl(2, prompt_text="plain", prompt_token_ids=[9, 9]))
    s.flush()
    rec = s.get("req-1")
    assert rec["prompt_text"] == "my <X>" and rec["output_text"] == "no <X> here"
    assert rec["prompt_token_ids"] == encode("my <X>")  # not the real ids: they would spell the secret
    assert len(rec["prompt_token_sha256"]) == 64
    assert rec["logprobs"][0]["top"][1] == [6, -2.0]
    assert s.get("req-2")["prompt_token_ids"] == [9, 9]  # nothing redacted: the real ids
    s.close()


def test_unencodable_strings_do_not_lose_the_batch(store):
    bad = _tl(1, user="\ud800 lone surrogate")
    bad.error = "\udfff"
    store.put(bad)
    store.put(_tl(2))
    store.flush()
    assert store.count() == 2 and store.failed == 0
    assert store.get("req-1")["user"].endswith("lone surrogate")


def test_backlog_bound_drops_and_counts(tmp_path):
    dropped = []
    s = RequestStore(tmp_path / "r.sqlite3", max_backlog=0, on_drop=dropped.append)
    assert not s.put(_tl(1))
    assert s.dropped == 1 and dropped == [1]
    s.close()
