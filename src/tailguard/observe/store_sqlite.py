"""The SQLite backend of the request store: one WAL file, the embedded default.

Schema versions live in ``PRAGMA user_version``; files written by an older tailguard are migrated in place, one written
by a newer one is refused. Reads run on per-thread connections beside the writer (WAL lets them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from tailguard.observe.store import (
    ALERT_COLUMNS,
    COLUMNS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    SQLITE_SCHEMA,
    RequestStore,
    SchemaError,
    load_secret,
    pseudonym,
    withhold_ids,
)

log = logging.getLogger("tailguard.store")

_INSERT = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
_INSERT_SAMPLE = f"INSERT INTO queue_samples ({', '.join(SAMPLE_COLUMNS)}) VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})"
_INSERT_ALERT = f"INSERT INTO slo_alerts ({', '.join(ALERT_COLUMNS)}) VALUES ({', '.join('?' * len(ALERT_COLUMNS))})"

# Columns added after schema version 1, for files written by an older tailguard.
_ADDED_COLUMNS = (
    ("lane", "TEXT"), ("client", "TEXT"), ("region", "TEXT"), ("degraded", "INTEGER NOT NULL DEFAULT 0"),
    ("slo_action", "TEXT"),
)
# Schema 3 -> 4: sampled internals on requests, the machine's window on queue samples (all nullable: old rows have
# none).
_ADDED_IN_4 = (("requests", "internals", "TEXT"), ("queue_samples", "cpu", "REAL"), ("queue_samples", "rss", "REAL"))


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

    def _open_writer(self) -> sqlite3.Connection:
        conn = _connect(self.path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; a crash may lose the last batch only
        return conn

    def _close_writer(self, conn: sqlite3.Connection) -> None:
        conn.close()

    def _write(self, conn: sqlite3.Connection, timelines: list, samples: list[tuple],
               alerts: list[dict[str, Any]] | None = None) -> bool:
        rows, alert_rows, bad = self._build_rows(timelines, alerts)
        try:
            conn.execute("BEGIN")
            conn.executemany(_INSERT, rows)
            if samples:
                conn.executemany(_INSERT_SAMPLE, samples)
            if alert_rows:
                conn.executemany(_INSERT_ALERT, alert_rows)
            conn.execute("COMMIT")
            self.written += len(rows)
        except Exception:  # noqa: BLE001 - retry one by one so a single bad row loses only itself
            log.exception("request store: a batch of %d records failed; retrying one by one", len(rows))
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            for sql, row in [*((_INSERT, r) for r in rows), *((_INSERT_ALERT, r) for r in alert_rows)]:
                try:
                    conn.execute(sql, row)
                    if sql is _INSERT:
                        self.written += 1
                except Exception:  # noqa: BLE001
                    log.exception("request store: record %s could not be written", row[0])
                    bad += 1
        self._count_failed(bad)
        return True
