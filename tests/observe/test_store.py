"""The request store: WAL, schema version, exactly-once batch writes off the caller's thread, retention, text rules.

Most tests run against both backends: SQLite (a file in tmp_path) and PostgreSQL (a fresh database on the session's
throwaway server, tests/pg_cluster.py). The PostgreSQL-only ones (restarts, outages, the server) are in
test_store_pg.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time

import pytest

from tailguard.observe.store import SCHEMA_VERSION, SECRET_ENV, SECRET_FILE, RequestStore, SchemaError
from tailguard.observe.stores import open_store
from tailguard.observe.timeline import Outcome, Timeline
from tests.pg_cluster import shared_cluster


def _tl(i: int, age_days: float = 0.0, **kw) -> Timeline:
    tl = Timeline(request_id=f"req-{i}", endpoint="/v1/chat/completions", received=50.0,
                  received_unix=time.time() - age_days * 86400, tokenized=50.001, scheduled=50.002,
                  first_token=50.01, last_token=50.02, token_times=[50.01, 50.02], num_prompt_tokens=5,
                  num_output_tokens=2, finish_reason="length", **kw)
    tl.finalize(200, Outcome.SUCCESS, at=50.021)
    return tl


@pytest.fixture(params=["sqlite", "postgresql"])
def make_store(request, tmp_path):
    """``make_store(name, **kw)``: a store on this test's backend. SQLite: one file per name; PostgreSQL: one database
    per test (a second store on it is a second gateway on the same database). Every store is closed at the end."""
    opened: list[RequestStore] = []
    with contextlib.ExitStack() as stack:
        if request.param == "postgresql":
            url = stack.enter_context(shared_cluster().database())

            def target(name: str = "r") -> str:
                return url
        else:
            def target(name: str = "r") -> str:
                return str(tmp_path / f"{name}.sqlite3")

        def make(name: str = "r", **kw) -> RequestStore:
            s = open_store(target(name), **kw)
            opened.append(s)
            return s

        make.backend = request.param
        make.target = target
        yield make
        for s in opened:
            s.close(deadline_s=5)


@pytest.fixture
def store(make_store):
    return make_store(flush_interval=0.01)


def test_schema_and_wal(tmp_path):
    open_store(tmp_path / "r.sqlite3").close()
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


def test_retention(make_store):
    s = make_store(retention_days=15, flush_interval=0.01)
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
    s2 = make_store(retention_days=15)
    s2.flush()
    deadline = time.monotonic() + 5
    while s2.count() != 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r[0] for r in s2.query("SELECT request_id FROM requests")] == ["req-2"]
    s2.close()


def test_a_reader_changes_nothing(make_store, tmp_path):
    """replay, rebuild and hotspots open the store to read: old records stay (the server's retention decides), no
    schema or key is written, and a store that is not there is an error, not a new empty one."""
    s = make_store(retention_days=90, flush_interval=0.01)
    s.put(_tl(1, age_days=30))
    s.flush()
    s.close()
    reader = open_store(make_store.target(), read_only=True)  # the default retention is 15 days
    try:
        assert reader.get("req-1")["request_id"] == "req-1"
        assert reader.put(_tl(2)) is False  # takes no records
        time.sleep(0.2)  # a writer's sweep would have run by now
    finally:
        reader.close()
    assert make_store(retention_days=90).get("req-1") is not None
    if make_store.backend == "sqlite":
        typo = tmp_path / "no" / "such" / "requests.sqlite3"
        with pytest.raises(FileNotFoundError, match="no request store"):
            open_store(typo, read_only=True)
        assert not (tmp_path / "no").exists()
        other = tmp_path / "other.sqlite3"
        sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
        with pytest.raises(SchemaError, match="not a tailguard request store"):
            open_store(other, read_only=True)


def test_newer_schema_refused(make_store):
    make_store().close()
    if make_store.backend == "sqlite":
        conn = sqlite3.connect(make_store.target())
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
        conn.close()
    else:
        import psycopg

        with psycopg.connect(make_store.target(), autocommit=True) as conn:
            conn.execute("UPDATE tailguard_meta SET value = %s WHERE name = 'schema_version'",
                         (str(SCHEMA_VERSION + 1),))
    with pytest.raises(SchemaError, match="schema version"):
        make_store()


def test_text_needs_a_redactor(make_store):
    with pytest.raises(ValueError):
        make_store(store_text=True)


def test_text_is_redacted_and_tokens_follow_the_redacted_text(make_store):
    def redact(text):
        return None if text is None else text.replace("secret", "<X>")

    def encode(text):
        return [ord(c) for c in text]

    s = make_store("r", store_text=True, redact=redact, encode=encode, flush_interval=0.01)
    tl = _tl(1, prompt_text="my secret", output_text="no secret here", prompt_token_ids=[1, 2, 3],
             logprobs=[{"id": 5, "logprob": -0.1, "top": [[5, -0.1], [6, -2.0]]}])
    s.put(tl)
    s.put(_tl(2, prompt_text="plain", prompt_token_ids=[9, 9]))
    s.flush()
    rec = s.get("req-1")
    assert rec["prompt_text"] == "my <X>" and rec["output_text"] == "no <X> here"
    assert rec["prompt_token_ids"] == encode("my <X>")  # not the real ids: they would spell the secret
    assert len(rec["prompt_token_hmac"]) == 64
    # The output was redacted: the candidate set keeps its probabilities but not the ids that spell the output.
    assert rec["logprobs"] == [{"id": None, "logprob": -0.1, "top": [[None, -0.1], [None, -2.0]],
                                "ids_withheld": True}]
    assert s.get("req-2")["prompt_token_ids"] == [9, 9]  # nothing redacted: the real ids
    s.close()


def test_unencodable_strings_do_not_lose_the_batch(store):
    bad = _tl(1, user="\ud800 lone surrogate")
    bad.error = "\udfff\x00"  # PostgreSQL text cannot hold NUL
    store.put(bad)
    store.put(_tl(2))
    store.flush()
    assert store.count() == 2 and store.failed == 0
    assert store.get("req-1")["user"] == store.pseudonym("\ud800 lone surrogate")


def test_backlog_bound_drops_and_counts(make_store):
    dropped = []
    s = make_store("r", max_backlog=0, on_drop=dropped.append)
    assert not s.put(_tl(1))
    assert s.dropped == 1 and dropped == [1]
    s.close()


# --- nothing lost silently (issue 10, item 8) -----------------------------------------------------------------------
class _Gate:
    """A redactor that holds the writer thread on its first call until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, text):
        self.entered.set()
        self.release.wait(30)
        return text


def test_put_after_close_is_refused_and_counted(make_store, caplog):
    dropped = []
    s = make_store("r", flush_interval=0.01, on_drop=dropped.append)
    assert s.put(_tl(1))
    assert s.close() == 0
    with caplog.at_level(logging.ERROR, logger="tailguard.store"):
        assert not s.put(_tl(2))
        assert not s.put_alert({"id": "a", "kind": "alert", "name": "x", "event": "raised", "at": time.time()})
    assert s.dropped == 2 and dropped == [1, 1]
    assert "req-2" in caplog.text and "closed" in caplog.text
    assert s.count() == 1


def test_close_drains_the_backlog_it_holds(make_store):
    gate = _Gate()
    s = make_store("r", store_text=True, redact=gate, batch_size=1, flush_interval=0.01)
    for i in range(40):
        assert s.put(_tl(i, prompt_text="p"))
    assert gate.entered.wait(10)
    closer = threading.Thread(target=s.close)  # the default deadline: far longer than this backlog needs
    closer.start()
    gate.release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert s.count() == 40 and s.dropped == 0 and s.backlog == 0


def test_close_deadline_counts_and_logs_what_was_not_written(make_store, caplog):
    gate = _Gate()
    dropped = []
    s = make_store("r", store_text=True, redact=gate, batch_size=1, flush_interval=0.01,
                   on_drop=dropped.append)
    for i in range(50):
        assert s.put(_tl(i, prompt_text="p"))
    assert gate.entered.wait(10)

    def release_once_abandoned():  # the writer is stuck until the close deadline has passed
        while not s._abandon.is_set():
            time.sleep(0.005)
        gate.release.set()

    threading.Thread(target=release_once_abandoned, daemon=True).start()
    with caplog.at_level(logging.ERROR, logger="tailguard.store"):
        lost = s.close(deadline_s=0.05)
    assert lost == 49  # the record in hand was finished; every queued one was counted, not written
    assert s.count() == 1 and s.written == 1
    assert s.dropped == 49 and dropped == [49]
    assert s.written + s.dropped == 50 and s.backlog == 0
    assert "49 records could not be written" in caplog.text


def test_backlog_is_bounded_by_bytes(make_store):
    gate = _Gate()
    dropped = []
    s = make_store("r", store_text=True, redact=gate, batch_size=1, flush_interval=0.01,
                   max_backlog_bytes=4 << 20, on_drop=dropped.append)
    assert s.put(_tl(0, prompt_text="x"))
    assert gate.entered.wait(10)  # the writer holds record 0; the rest queue up
    big = "y" * (1 << 20)
    accepted = sum(s.put(_tl(i, prompt_text=big)) for i in range(1, 11))
    assert 2 <= accepted <= 4  # 1 MiB prompts against a 4 MiB budget
    assert s.dropped == 10 - accepted and sum(dropped) == s.dropped
    assert s.backlog_bytes <= 4 << 20
    # A single record larger than the whole budget still goes through when nothing is queued.
    gate.release.set()
    assert s.flush(30)
    assert s.put(_tl(99, prompt_text="z" * (5 << 20)))
    assert s.flush(30) and s.count() == 1 + accepted + 1
    s.close()


# --- pseudonyms and what derives from redacted text (issue 10, item 12) ---------------------------------------------
def test_user_is_stored_as_a_keyed_pseudonym(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "r.sqlite3"
    s = open_store(path, flush_interval=0.01)
    s.put(_tl(1, user="alice@example.com"))
    s.flush()
    stored = s.get("req-1")["user"]
    assert stored != "alice@example.com" and len(stored) == 32 and stored == s.pseudonym("alice@example.com")
    assert stored != hashlib.sha256(b"alice@example.com").hexdigest()[:32]  # keyed, not a plain hash
    s.close()
    conn = sqlite3.connect(path)
    assert not [r for r in conn.execute("SELECT * FROM requests") if "alice" in json.dumps(list(r))]
    conn.close()
    key_file = tmp_path / SECRET_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    # Same deployment (same key file): the same pseudonym, so a user's records still group together.
    again = open_store(path)
    assert again.pseudonym("alice@example.com") == stored
    again.close()
    # Another key (config or environment): another pseudonym.
    assert open_store(tmp_path / "b" / "r.sqlite3", secret="s1").pseudonym("alice@example.com") != stored
    monkeypatch.setenv(SECRET_ENV, "from-env")
    env = open_store(tmp_path / "c" / "r.sqlite3")
    assert env.pseudonym("x") == open_store(tmp_path / "d" / "r.sqlite3", secret="from-env").pseudonym("x")
    assert not (tmp_path / "c" / SECRET_FILE).exists()


def test_prompt_digest_is_salted(make_store):
    ids = [1, 2, 3]

    def store_digest(secret):
        s = make_store(secret, store_text=True, redact=lambda t: t, encode=list, secret=secret, flush_interval=0.01)
        s.put(_tl(1, prompt_text="abc", prompt_token_ids=ids))
        s.flush()
        digest = s.get("req-1")["prompt_token_hmac"]
        s.close()
        return digest

    a, b = store_digest("k1"), store_digest("k2")
    assert a != b  # a dictionary of hashed prompts built elsewhere matches nothing here
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest() not in (a, b)
    assert hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest() not in (a, b)
    assert store_digest("k1") == a  # but a replay in the same deployment matches


def test_logprob_ids_only_where_their_text_needed_no_redaction(make_store):
    def redact(text):
        return None if text is None else text.replace("secret", "<X>")

    vocab = {1: "all ", 2: "fine", 3: "secret"}
    lps = [{"id": i, "logprob": -0.5, "top": [[i, -0.5], [9, -3.0]]} for i in (1, 2)]
    s = make_store("r", store_text=True, redact=redact, flush_interval=0.01)
    s.put(_tl(1, output_text="all fine", logprobs=lps))  # clean output: the full candidate set (T3)
    s.put(_tl(2, output_text=None, logprobs=lps))  # no output recorded (aborted): cannot check, so withhold
    s.flush()
    assert s.get("req-1")["logprobs"] == lps
    assert all(e["id"] is None and e["ids_withheld"] for e in s.get("req-2")["logprobs"])
    s.close()
    # With a decoder, the ids themselves are judged: they may run past the text that was sent (stop strings).
    d = make_store("d", store_text=True, redact=redact, flush_interval=0.01,
                   decode=lambda ids: "".join(vocab[i] for i in ids))
    spelled = [*lps, {"id": 3, "logprob": -0.1, "top": [[3, -0.1]]}]
    d.put(_tl(1, output_text="all fine", logprobs=spelled))
    d.put(_tl(2, output_text=None, logprobs=lps))
    d.flush()
    assert all(e["id"] is None for e in d.get("req-1")["logprobs"])
    assert d.get("req-2")["logprobs"] == lps
    d.close()


def test_stop_strings_are_client_text(make_store):
    sampling = {"max_tokens": 4, "stop": ["my secret"]}
    s = make_store("r", flush_interval=0.01)
    s.put(_tl(1, sampling=sampling))
    s.flush()
    assert s.get("req-1")["sampling"] == {"max_tokens": 4, "stop": None, "stop_count": 1}
    s.close()
    t = make_store("t", store_text=True, redact=lambda x: x and x.replace("secret", "<X>"),
                   flush_interval=0.01)
    t.put(_tl(1, sampling=sampling))
    t.flush()
    assert t.get("req-1")["sampling"]["stop"] == ["my <X>"]
    t.close()


_SCHEMA_2_REQUESTS = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT, request_id TEXT NOT NULL, received_at REAL NOT NULL,
    endpoint TEXT NOT NULL, model TEXT, user TEXT, business_type TEXT, stream INTEGER NOT NULL,
    status INTEGER NOT NULL, outcome TEXT NOT NULL, finish_reason TEXT, error TEXT, prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL, e2e REAL NOT NULL, ttft REAL, tpot REAL, tokenize REAL NOT NULL,
    queue REAL NOT NULL, prefill REAL NOT NULL, decode REAL NOT NULL, stream_time REAL NOT NULL, record TEXT NOT NULL,
    prompt_text TEXT, output_text TEXT, prompt_token_ids TEXT, prompt_token_sha256 TEXT, logprobs TEXT,
    lane TEXT, client TEXT, region TEXT, degraded INTEGER NOT NULL DEFAULT 0, slo_action TEXT
);
"""


def test_schema_2_database_is_migrated_and_stays_readable(tmp_path):
    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA_2_REQUESTS)
    body = json.dumps({"timestamps": {}, "token_times": [0.1], "token_sent": [], "sampling": None,
                       "resources": None, "preemptions": 0})
    conn.execute(
        "INSERT INTO requests (request_id, received_at, endpoint, user, stream, status, outcome, prompt_tokens,"
        " output_tokens, e2e, tokenize, queue, prefill, decode, stream_time, record, prompt_text, output_text,"
        " prompt_token_sha256, logprobs) VALUES ('old-1', ?, '/v1/completions', 'bob', 0, 200, 'success', 3, 1,"
        " 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, ?, 'hi <EMAIL_ADDRESS>', 'ok', ?, ?)",
        (time.time(), body, hashlib.sha256(b"[1,2,3]").hexdigest(),
         json.dumps([{"id": 7, "logprob": -0.2, "top": [[7, -0.2]]}])))
    conn.execute("PRAGMA user_version=2")
    conn.commit()
    conn.close()
    s = open_store(path, secret="k")
    assert s.schema_version == SCHEMA_VERSION
    rec = s.get("old-1")
    assert rec["user"] == s.pseudonym("bob") and rec["token_times"] == [0.1]
    assert rec["prompt_text"] == "hi <EMAIL_ADDRESS>"
    assert rec["prompt_token_hmac"] is None  # an unsalted digest cannot be salted afterwards: dropped
    assert rec["logprobs"] == [{"id": None, "logprob": -0.2, "top": [[None, -0.2]], "ids_withheld": True}]
    s.put(_tl(2, user="bob"))
    s.flush()
    assert s.get("req-2")["user"] == rec["user"]
    s.close()
    # Opening it again migrates nothing twice.
    again = open_store(path, secret="k")
    assert again.get("old-1")["user"] == s.pseudonym("bob")
    again.close()
    assert os.path.exists(path)


def test_a_dead_writer_loses_nothing_silently(make_store, caplog):
    s = make_store("r", flush_interval=0.01)
    real = s._q

    class Broken:  # the writer's next read fails as if something below it broke
        def put(self, item):
            real.put(item)

        def get(self, *a, **kw):
            raise RuntimeError("something below the writer broke")

        get_nowait = get

    s._q = Broken()
    with caplog.at_level(logging.ERROR, logger="tailguard.store"):
        accepted = sum(s.put(_tl(i)) for i in range(5))
        s._thread.join(10)
        assert not s._thread.is_alive()
        refused = sum(not s.put(_tl(i)) for i in range(5, 8))
        lost = s.close(deadline_s=1)
    assert "writer thread died" in caplog.text
    assert refused == 3
    assert s.written + s.failed + s.dropped == 8 and lost == accepted - s.written - s.failed


def test_a_record_still_in_memory_reads_like_the_stored_one(make_store):
    s = make_store("r", flush_interval=0.01)
    tl = _tl(1, user="carol", sampling={"max_tokens": 4, "stop": ["carol's phone"]})
    live = s.record_of(tl)
    s.put(tl)
    s.flush()
    stored = s.get("req-1")
    assert live["user"] == stored["user"] == s.pseudonym("carol")
    assert live["sampling"] == stored["sampling"] == {"max_tokens": 4, "stop": None, "stop_count": 1}
    assert "carol" not in json.dumps(live)
    s.close()


def test_the_servers_recent_cache_lets_go_of_records_the_store_has(tmp_path):
    """The recent-records cache bridges the store writer's lag and no more: once a record is committed the store
    answers for it, so finished timelines do not pile up (4,096 of them made every full collection of the cycle
    collector scan ~80,000 objects)."""
    import httpx

    from tests.serving_helpers import ADMIN, fake_server, settle

    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with fake_server(tmp_path) as s:
        for i in range(20):
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": f"rc-{i}"}, timeout=10)
            assert r.status_code == 200
        settle(s)
        assert s.state.store.written == 20
        r = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"X-Request-ID": "rc-20"}, timeout=10)
        assert r.status_code == 200
        settle(s)
        assert list(s.state.recent) == [("rc-20", None)]  # the 20 written before it were let go at its close
        for rid in ("rc-3", "rc-20"):
            rec = httpx.get(f"{s.url}/v1/requests/{rid}", headers=ADMIN, timeout=10).json()
            assert rec["request_id"] == rid and rec["status"] == 200


def test_another_applications_database_is_refused_untouched(tmp_path):
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaError, match="users"):
        open_store(path)
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["users"]
    conn.close()
