"""The SQLite store when the file cannot be written for a while (another process holds its lock, the disk is full) and
when it refuses rows: held batches are written once it can, refused rows fail alone, and the log stays short."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator

import pytest

from tailguard.observe.store_sqlite import SQLiteStore
from tailguard.observe.stores import open_store
from tests.observe.test_store import _tl


@pytest.fixture
def quick_lock_wait(monkeypatch):
    """The writer gives up waiting on a lock after 50 ms (SQLite's busy handler) instead of seconds, so that a test
    holds the lock past it quickly."""
    real_open = SQLiteStore._open_writer

    def open_writer(self: SQLiteStore) -> sqlite3.Connection:
        conn = real_open(self)
        conn.execute("PRAGMA busy_timeout=50")
        return conn

    monkeypatch.setattr(SQLiteStore, "_open_writer", open_writer)


@contextlib.contextmanager
def write_lock(path: str) -> Iterator[None]:
    """Another process's write transaction (a backup tool, ``sqlite3 FILE 'BEGIN IMMEDIATE'``, a VACUUM)."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        yield
        other.execute("ROLLBACK")
    finally:
        other.close()


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def retried(store: SQLiteStore, times: int = 3) -> bool:
    """Wait until the writer has retried its batch ``times`` times (or, in a store that does not hold batches, until
    it gave records up)."""
    return wait_for(lambda: getattr(store, "retries", 0) >= times or store.failed > 0 or store.written > 0)


def stored_ids(path: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return sorted(r[0] for r in conn.execute("SELECT request_id FROM requests"))


def test_a_batch_is_held_while_another_process_holds_the_lock(tmp_path, quick_lock_wait, caplog):
    path = str(tmp_path / "r.sqlite3")
    store = open_store(path)
    try:
        with caplog.at_level(logging.INFO, logger="tailguard.store"), write_lock(path):
            for i in range(10):
                assert store.put(_tl(i))
            assert retried(store)
            assert store.written == 0 and store.failed == 0  # held: neither written nor given up
        assert store.flush(timeout=10)
        assert stored_ids(path) == sorted(f"req-{i}" for i in range(10))
        assert (store.written, store.failed, store.dropped) == (10, 0, 0)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("database is locked" in m and "holding" in m for m in warnings), warnings
        assert any("writable again" in m for m in warnings), warnings
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        store.close(deadline_s=5)


def test_a_batch_is_held_while_the_disk_is_full(tmp_path, monkeypatch):
    path = str(tmp_path / "r.sqlite3")
    open_store(path).close()  # a request store first: tailguard refuses another application's database
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:  # space to free later
        conn.execute("CREATE TABLE ballast (b BLOB)")
        conn.executemany("INSERT INTO ballast VALUES (?)", [(b"x" * 4000,)] * 50)
    real_open = SQLiteStore._open_writer

    def open_full(self: SQLiteStore) -> sqlite3.Connection:
        conn = real_open(self)
        # The file may not grow past its size now: every new page fails with SQLITE_FULL ("database or disk is
        # full"), as on a full disk, until pages are freed.
        conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
        return conn

    monkeypatch.setattr(SQLiteStore, "_open_writer", open_full)
    store = open_store(path)
    try:
        for i in range(300):  # more than the free room in the pages the file has
            assert store.put(_tl(i))
        assert retried(store)
        assert store.failed == 0 and store.backlog > 0  # held
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("DELETE FROM ballast")  # space again (its pages go to the free list, the file keeps its size)
        assert store.flush(timeout=10)
        assert stored_ids(path) == sorted(f"req-{i}" for i in range(300))
        assert (store.written, store.failed, store.dropped) == (300, 0, 0)
    finally:
        store.close(deadline_s=5)


def test_the_close_deadline_counts_a_held_batch_as_dropped(tmp_path, quick_lock_wait, caplog):
    path = str(tmp_path / "r.sqlite3")
    store = open_store(path)
    with caplog.at_level(logging.ERROR, logger="tailguard.store"), write_lock(path):
        for i in range(3):
            store.put(_tl(i))
        assert retried(store)
        assert store.close(deadline_s=0.3) == 3
    assert (store.written, store.failed, store.dropped) == (0, 0, 3)
    assert "3 records could not be written within the 0 s close deadline" in caplog.text
    assert "stuck" not in caplog.text  # the held batch noticed the deadline
    assert stored_ids(path) == []


def test_refused_rows_fail_alone_and_are_logged_once_a_period(tmp_path, caplog):
    path = str(tmp_path / "r.sqlite3")
    store = open_store(path)
    try:
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON requests WHEN NEW.request_id LIKE 'req-1__' "
                         "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END")
        with caplog.at_level(logging.INFO, logger="tailguard.store"):
            for i in range(100, 140):  # refused
                store.put(_tl(i))
            for i in range(5):  # written
                store.put(_tl(i))
            assert store.flush(timeout=20)
        assert stored_ids(path) == [f"req-{i}" for i in range(5)]
        assert (store.written, store.failed) == (5, 40)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        # A line for the batch, one for its first refused row; the other 39 rows wait for the next period.
        assert 1 <= len(errors) <= 3, [r.getMessage() for r in errors]
        assert sum(r.exc_info is not None for r in errors) <= 1
        assert "refused by a trigger" in caplog.text

        # Ten seconds on, the next refused row's line counts those it stood for.
        caplog.clear()
        store._failure_logged = {reason: at - 11 for reason, at in store._failure_logged.items()}
        store._traceback_logged -= 11
        store.put(_tl(199))
        assert store.flush(timeout=10)
        lines = [r.getMessage() for r in caplog.records if "req-199" in r.getMessage()]
        assert len(lines) == 1 and "(40 record failure(s)" in lines[0], lines
    finally:
        store.close(deadline_s=5)
