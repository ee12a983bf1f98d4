"""The PostgreSQL request store against a real server (tests/pg_cluster.py): restarts and outages lose nothing and
duplicate nothing, the bounded backlog counts what it drops, retention runs in the database, gateways sharing a
database agree, and a server with ``store_path=postgresql://...`` serves its records from it."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import psycopg
import pytest
from pydantic import ValidationError

from tailguard.observe import store_pg
from tailguard.observe.store import SCHEMA_VERSION, SECRET_ENV, RequestStore, SchemaError
from tailguard.observe.store_pg import PostgresStore, StoreUnavailableError, redact_url, to_postgres_sql
from tailguard.observe.stores import open_store
from tailguard.serving.config import ServerConfig
from tests.net import free_port
from tests.observe.test_store import _tl
from tests.pg_cluster import shared_cluster
from tests.serving_helpers import ADMIN, fake_server, settle, start_serve, stop_serve


@pytest.fixture(scope="module")
def cluster():
    return shared_cluster()


@pytest.fixture
def url(cluster):
    with cluster.database() as u:
        yield u


def _rows(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


def test_the_factory_picks_the_backend_and_the_schema_is_versioned(url, tmp_path):
    s = open_store(url, flush_interval=0.01)
    assert isinstance(s, PostgresStore) and isinstance(open_store(url), RequestStore)
    assert s.schema_version == SCHEMA_VERSION
    assert _rows(url, "SELECT value FROM tailguard_meta WHERE name = 'schema_version'") == [(str(SCHEMA_VERSION),)]
    tables = {r[0] for r in _rows(url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"requests", "queue_samples", "slo_alerts", "tailguard_meta"} <= tables
    s.close()
    assert type(open_store(tmp_path / "r.sqlite3")).__name__ == "SQLiteStore"
    with pytest.raises(ValueError, match="unsupported request store URL scheme 'mysql'"):
        open_store("mysql://x/y")


def test_a_table_tailguard_did_not_create_is_refused(url):
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE requests (id INT)")
    with pytest.raises(SchemaError, match="did not create"):
        open_store(url)


def test_an_unreachable_database_is_a_clear_error_without_the_password():
    bad = f"postgresql://tailguard:hunter2@127.0.0.1:{free_port()}/nowhere?connect_timeout=3"
    with pytest.raises(StoreUnavailableError, match="cannot connect") as err:
        open_store(bad)
    assert "hunter2" not in str(err.value) and "***" in str(err.value)
    assert redact_url(bad) == bad.replace("hunter2", "***")
    with pytest.raises(ValueError, match="bad PostgreSQL URL"):
        open_store("postgresql://tailguard@127.0.0.1/db?nonsense_option=1")


def test_restart_mid_run_loses_and_duplicates_nothing(cluster, url):
    """The server stops while records stream in and starts again: every record is written exactly once."""
    s = open_store(url, flush_interval=0.01, batch_size=64)
    assert s.count() == 0  # a read connection from before the restart, pooled: it must be replaced, not reused
    total, restarted = 3000, threading.Event()

    def restart():
        while s.written < 500:  # well into the run, with records in flight
            time.sleep(0.005)
        cluster.stop("fast")
        time.sleep(1.0)  # records keep arriving while it is down
        cluster.start()
        restarted.set()

    t = threading.Thread(target=restart)
    t.start()
    for i in range(total):
        assert s.put(_tl(i))
        if i % 50 == 0:
            time.sleep(0.01)  # about 1,500 records/s: the run spans the restart
    t.join(120)
    assert restarted.is_set()
    assert s.flush(60), f"{s.backlog} records still pending"
    assert s.outages >= 1 and s.retries >= 1  # the writer did lose the database
    assert s.dropped == 0 and s.failed == 0 and s.written == total
    assert s.count() == total  # the reader reconnected too
    ids = s.query("SELECT COUNT(DISTINCT request_id) FROM requests")[0][0]
    assert ids == total
    s.close()


def test_an_outage_longer_than_the_backlog_drops_and_counts_the_excess(cluster, url):
    dropped: list[int] = []
    s = open_store(url, flush_interval=0.01, max_backlog=100, on_drop=dropped.append)
    s.put(_tl(0))
    assert s.flush(10)
    cluster.stop("fast")
    try:
        accepted = sum(s.put(_tl(i)) for i in range(1, 301))
        assert accepted == 100  # the bound, not memory, decides
        assert s.dropped == 200 and sum(dropped) == 200
    finally:
        cluster.start()
    assert s.flush(60)
    assert s.count() == 101 and s.written == 101 and s.written + s.dropped == 301
    s.close()


def test_close_during_an_outage_counts_what_it_could_not_write(cluster, url):
    s = open_store(url, flush_interval=0.01)
    cluster.stop("fast")
    try:
        for i in range(20):
            assert s.put(_tl(i))
        lost = s.close(deadline_s=0.5)
    finally:
        cluster.start()
    assert lost == 20 and s.dropped == 20 and s.written == 0


def test_retention_runs_in_the_database_by_its_clock_and_periodically(url):
    s = open_store(url, retention_days=15, flush_interval=0.01, retention_interval=0.2)
    s.put(_tl(1, age_days=16))
    s.put(_tl(2, age_days=14))
    s.put_sample(time.time() - 20 * 86400, 1, 0, 0, 0, 10)
    s.put_alert({"id": "a", "kind": "alert", "name": "x", "event": "raised", "at": time.time() - 20 * 86400})
    assert s.flush()
    # The writer's sweep (every 0.2 s here) deletes the old rows without being asked.
    deadline = time.monotonic() + 10
    while s.count() != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r[0] for r in s.query("SELECT request_id FROM requests")] == ["req-2"]
    assert s.query("SELECT COUNT(*) FROM queue_samples")[0][0] == 0
    assert s.alerts() == []
    # Called directly, against the database's own clock (now()): a shorter period cuts req-2 (14 days old) too.
    s.retention_days = 13
    assert s.enforce_retention() == 1
    assert s.count() == 0
    s.close()


def test_gateways_sharing_a_database_agree_on_pseudonyms(url, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    a, b = open_store(url, flush_interval=0.01), open_store(url, flush_interval=0.01)
    assert a.pseudonym("alice") == b.pseudonym("alice") != "alice"
    assert len(_rows(url, "SELECT value FROM tailguard_meta WHERE name = 'pseudonym_key'")) == 1
    a.put(_tl(1, user="alice"))
    b.put(_tl(2, user="alice"))
    assert a.flush() and b.flush()
    # Written by two gateways, grouped as one user; the query speaks SQLite's dialect (a bare `user`, `?`).
    assert [r[0] for r in a.query("SELECT request_id FROM requests WHERE user = ? ORDER BY request_id",
                                  (a.pseudonym("alice"),))] == ["req-1", "req-2"]
    assert open_store(url, secret="other").pseudonym("alice") != a.pseudonym("alice")
    a.close()
    b.close()


def test_sqlite_dialect_queries_are_translated():
    assert to_postgres_sql("SELECT user, u.user FROM requests u WHERE request_id LIKE 'a%?' AND user = ?") == (
        "SELECT \"user\", u.user FROM requests u WHERE request_id LIKE 'a%%?' AND \"user\" = %s")
    assert to_postgres_sql('SELECT "user", current_user, user_id FROM t') == (
        'SELECT "user", current_user, user_id FROM t')


def test_config_takes_a_postgresql_url():
    pg = "postgresql://tailguard@db:5432/records"
    assert ServerConfig(store=pg).store_path == pg
    assert ServerConfig(store_path=pg).store_path == pg
    with pytest.raises(ValidationError, match="unsupported request store URL scheme"):
        ServerConfig(store_path="mysql://db/records")


def test_server_writes_to_postgresql_and_another_gateway_reads_the_records(tmp_path, url):
    with fake_server(tmp_path, store_path=url) as server:
        assert isinstance(server.state.store, PostgresStore)
        for i in range(5):
            r = httpx.post(server.url + "/v1/chat/completions", headers={"X-Request-ID": f"pg-{i}"}, timeout=30,
                           json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert r.status_code == 200, r.text
        settle(server)
        rec = httpx.get(server.url + "/v1/requests/pg-3", headers=ADMIN, timeout=10).json()
        assert rec["request_id"] == "pg-3" and rec["outcome"] == "success" and rec["output_tokens"] == 3
    assert _rows(url, "SELECT COUNT(*) FROM requests") == [(5,)]
    # A second gateway on the same database (nothing in its memory) serves the first one's records from it.
    with fake_server(tmp_path / "b", store_path=url) as other:
        got = httpx.get(other.url + "/v1/requests/pg-3", headers=ADMIN, timeout=10).json()
        assert got["request_id"] == "pg-3" and got["received_at"] == rec["received_at"]
        assert got["stages"] == rec["stages"] and got["e2e"] == rec["e2e"]
        assert httpx.get(other.url + "/v1/alerts", headers=ADMIN, timeout=10).status_code == 200


def test_serve_command_line_takes_a_postgresql_store(url):
    """``tailguard serve --store postgresql://...`` as a user runs it; SIGTERM flushes the record into the database."""
    proc, base = start_serve("--model", "fake", "--store", url, "--log-level", "warning")
    try:
        r = httpx.post(base + "/v1/chat/completions", headers={"X-Request-ID": "cli-1"}, timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        stop_serve(proc)
    assert _rows(url, "SELECT request_id, outcome FROM requests") == [("cli-1", "success")]


def test_a_retried_commit_is_not_stored_twice(url):
    """A batch whose commit went through but whose acknowledgement was lost is retried with the same write keys;
    the retry (the INSERT every attempt after the first uses) must leave one row per record."""
    s = open_store(url, flush_interval=0.01)
    row = (*s._row(_tl(1)), uuid.uuid4())
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.cursor() as cur, cur.copy(store_pg._COPY) as copy:  # the first attempt
            copy.write_row(row)
        conn.execute(store_pg._INSERT, row)  # the retry
    assert s.count() == 1
    s.close()
