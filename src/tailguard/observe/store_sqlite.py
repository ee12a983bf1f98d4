"""The SQLite backend of the request store: one WAL file, the embedded default.

Schema versions live in ``PRAGMA user_version``; files written by an older tailguard are migrated in place, one written
by a newer one is refused. Reads run on per-thread connections beside the writer (WAL lets them).

A batch that cannot be written for a reason of the moment (another process holds the file's write lock: a backup, a
VACUUM, ``sqlite3 FILE 'BEGIN IMMEDIATE'``; the disk is full) is held and retried with backoff until it goes in or the
close deadline passes, while ``put`` queues behind it into the bounded backlog. Any other failure is a row's: the batch
is retried one row at a time, so that a bad row loses only itself. Failures are logged once per reason every 10 s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path

from tailguard.observe.store import (
    ALERT_COLUMNS,
    COLUMNS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    SQLITE_SCHEMA,
    RequestStore,
    SchemaError,
    first_line,
    load_secret,
    pseudonym,
    withhold_ids,
)

log = logging.getLogger("tailguard.store")

_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_INSERT_SAMPLE = f"INSERT INTO queue_samples ({', '.join(SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})"
_INSERT_ALERT = f"INSERT INTO slo_alerts ({', '.join(ALERT_COLUMNS)}) VALUES ({', '.join('?' * len(ALERT_COLUMNS))})"
_INSERT_OF = {"request": _INSERT, "alert": _INSERT_ALERT, "sample": _INSERT_SAMPLE}

# Columns added after schema version 1, for files written by an older tailguard.
_ADDED_COLUMNS = (
    ("lane", "TEXT"), ("client", "TEXT"), ("region", "TEXT"), ("degraded", "INTEGER NOT NULL DEFAULT 0"),
    ("slo_action", "TEXT"),
)
# Schema 3 -> 4: sampled internals on requests, the machine's window on queue samples (all nullable: old rows have
# none).
_ADDED_IN_4 = (("requests", "internals", "TEXT"), ("queue_samples", "cpu", "REAL"), ("queue_samples", "rss", "REAL"))


# Errors that say nothing about the rows (another process holds the write lock, the disk is full): the batch is held
# and retried with backoff, as the PostgreSQL store holds one through an outage. Primary result codes.
_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_FULL = 5, 6, 13
_TRANSIENT_CODES = frozenset((_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_FULL))
_TRANSIENT_MESSAGES = ("database is locked", "database table is locked", "database is busy", "disk is full")
# How long one write waits on another process's lock (SQLite's busy handler) before the batch is held: short, so that
# the retry loop, which holds it as long as need be, notices the close deadline.
_WRITER_BUSY_TIMEOUT_MS = 2000


def _transient(exc: BaseException) -> bool:
    """Whether a write failed for a reason of the moment (a lock, a full disk) rather than because of a row."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _TRANSIENT_CODES  # extended codes keep the primary one in the low byte
    return any(m in str(exc) for m in _TRANSIENT_MESSAGES)


# --- schema ---------------------------------------------------------------------------------------------------------
def _connect(path: str) -> sqlite3.Connection:
    """A connection to a path, or to a ``file:`` URI (a reader's ``?mode=ro``)."""
    conn = sqlite3.connect(path, timeout=10, check_same_thread=False, isolation_level=None,
                           uri=path.startswith("file:"))
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def _migrate_to_3(conn: sqlite3.Connection, key: bytes) -> None:
    """Rows written before schema 3 kept the raw user id, an unsalted prompt digest and token ids beside redacted
    text: pseudonymize the first, drop the second (it cannot be salted without the tokens), withhold the third."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
    if "prompt_token_sha256" in have and "prompt_token_hmac" not in have:
        conn.execute("ALTER TABLE requests RENAME COLUMN prompt_token_sha256 TO prompt_token_hmac")
        conn.execute("UPDATE requests SET prompt_token_hmac = NULL")
    conn.create_function("tailguard_pseudonym", 1, lambda v: pseudonym(key, v), deterministic=True)
    conn.execute("UPDATE requests SET user = tailguard_pseudonym(user) WHERE user IS NOT NULL AND user != ''")
    rows = conn.execute("SELECT id, logprobs FROM requests WHERE logprobs IS NOT NULL").fetchall()
    for row_id, raw in rows:
        try:
            cleaned = json.dumps(withhold_ids(json.loads(raw)), separators=(",", ":"))
        except (ValueError, TypeError, AttributeError):
            cleaned = None  # unreadable: dropping it is the safe side
        conn.execute("UPDATE requests SET logprobs = ? WHERE id = ?", (cleaned, row_id))


def open_schema(path: str, key: bytes | None = None) -> int:
    """Create, migrate or check the schema; returns the version in the file. ``key`` pseudonymizes old rows."""
    conn = _connect(path)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal" and path != ":memory:":
            log.warning("SQLite refused WAL mode (%s); writes may block readers", mode)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaError(f"{path} has schema version {version}; this tailguard understands up to {SCHEMA_VERSION}")
        exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'requests'").fetchone() is not None
        if not exists:
            # Another application's database (a path mistyped onto it): tailguard's tables must not be added to it.
            others = [r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' LIMIT 4")]
            if others:
                raise SchemaError(f"{path} holds other tables ({', '.join(others)}) and no request store: give "
                                  "tailguard a file of its own")
        conn.executescript(SQLITE_SCHEMA)  # idempotent; outside the transaction below (executescript commits first)
        if version == SCHEMA_VERSION:
            return version
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated it
            if not exists:
                version = SCHEMA_VERSION  # a new file: nothing to migrate
            elif version == 0:
                version = 1  # written before the schema had a version
            have = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
            for name, decl in _ADDED_COLUMNS:  # version 1 -> 2
                if name not in have:
                    conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
            if version < 3:
                _migrate_to_3(conn, key if key is not None else load_secret(path))
            for table, name, decl in _ADDED_IN_4:  # version 3 -> 4
                if name not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {decl}")
            if version < SCHEMA_VERSION:
                log.info("request store %s migrated from schema %d to %d", path, version, SCHEMA_VERSION)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        return SCHEMA_VERSION
    finally:
        conn.close()



class SQLiteStore(RequestStore):
    """The request store in one SQLite file (WAL). ``open_store(path)`` builds one."""

    def _open_backend(self, target: str, secret: str | bytes | None) -> None:
        self.path = target
        self._reader_local = threading.local()
        if self.read_only:
            self._key = load_secret(target, secret, create=False)
            self.schema_version = self._check_schema()
            return
        if target != ":memory:":
            Path(target).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self._key = load_secret(target, secret)
        self.schema_version = open_schema(target, self._key)

    def _check_schema(self) -> int:
        """A reader's check of the file: it exists, is a request store, and has this code's schema."""
        path = Path(self.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"no request store at {path}")
        try:
            conn = self._reader()
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            exists = conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'requests'").fetchone() is not None
        except sqlite3.DatabaseError as exc:
            raise SchemaError(f"{path}: {exc}") from exc
        if not exists:
            raise SchemaError(f"{path} has no requests table: not a tailguard request store")
        if version != SCHEMA_VERSION:
            raise SchemaError(f"{path} has schema version {version}; this tailguard reads {SCHEMA_VERSION} "
                              "(a server started on it, `tailguard serve --store`, migrates it)")
        return version

    # --- reads (any thread; WAL lets them run beside the writer) ----------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._reader_local, "conn", None)
        if conn is None:
            conn = _connect(f"{Path(self.path).expanduser().resolve().as_uri()}?mode=ro" if self.read_only
                            else self.path)
            conn.row_factory = sqlite3.Row
            self._reader_local.conn = conn
        return conn

    def query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        return self._reader().execute(sql, params).fetchall()

    # --- writer thread ------------------------------------------------------------------------------------------------
    def enforce_retention(self, conn: sqlite3.Connection | None = None, now: float | None = None) -> int:
        """Delete records (and queue samples, alerts) older than the retention period; returns rows deleted."""
        own = conn is None
        conn = conn or _connect(self.path)
        try:
            cutoff = (now if now is not None else time.time()) - self.retention_days * 86400.0
            deleted = conn.execute("DELETE FROM requests WHERE received_at < ?", (cutoff,)).rowcount
            conn.execute("DELETE FROM queue_samples WHERE t < ?", (cutoff,))
            conn.execute("DELETE FROM slo_alerts WHERE at < ?", (cutoff,))
            return deleted
        finally:
            if own:
                conn.close()

    def _sweep(self, conn: sqlite3.Connection) -> None:
        try:
            self.enforce_retention(conn)
        except sqlite3.Error as exc:
            if not _transient(exc):
                log.exception("retention sweep failed")
                return
            # Locked or full: nothing is lost by waiting; the next sweep (or the next start) deletes what is due.
            log.warning("request store %s: retention sweep skipped (%s); the next one tries again", self.path,
                        first_line(exc))

    def _open_writer(self) -> sqlite3.Connection:
        conn = _connect(self.path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; a crash may lose the last batch only
        conn.execute(f"PRAGMA busy_timeout={_WRITER_BUSY_TIMEOUT_MS}")
        return conn

    def _close_writer(self, conn: sqlite3.Connection) -> None:
        conn.close()

    # --- what _write_held asks of this backend ------------------------------------------------------------------
    def _commit(self, conn: sqlite3.Connection, rows: list[tuple], samples: list[tuple], alert_rows: list[tuple],
                first_attempt: bool) -> None:
        conn.execute("BEGIN")
        conn.executemany(_INSERT, rows)
        if samples:
            conn.executemany(_INSERT_SAMPLE, samples)
        if alert_rows:
            conn.executemany(_INSERT_ALERT, alert_rows)
        conn.execute("COMMIT")

    def _insert_one(self, conn: sqlite3.Connection, kind: str, row: tuple) -> None:
        conn.execute(_INSERT_OF[kind], row)

    def _transient(self, exc: BaseException, conn: sqlite3.Connection) -> bool:
        return _transient(exc)

    def _after_failure(self, conn: sqlite3.Connection, transient: bool) -> None:
        if conn.in_transaction:  # SQLite may have rolled it back already (a full disk does)
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
