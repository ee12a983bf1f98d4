"""The PostgreSQL backend of the request store: ``--store postgresql://USER@HOST:PORT/DB``, shared by several gateways.

The schema is SQLite's with PostgreSQL's types (REAL -> DOUBLE PRECISION, AUTOINCREMENT -> an identity column,
``user`` quoted: it is a reserved word here), versioned in the ``tailguard_meta`` table (a newer version is refused, a
table called ``requests`` that tailguard did not create is refused), created under an advisory lock so that gateways
starting together do not race. PostgreSQL support starts at schema 3; ``_MIGRATIONS`` takes a database written by an
older tailguard up one version at a time, in the schema lock's transaction.

The writer thread is the shared one (:class:`tailguard.observe.store.RequestStore`); what differs is what happens when
the database goes away. SQLite failing means a bad row; PostgreSQL failing usually means a restart, a failover or a
network cut. So a batch that fails for a reason of that kind (the connection broke, sqlstate classes 08, 40, 53, 57,
58, a read-only standby) is *held* and retried with backoff on a new connection, while ``put`` keeps queueing
behind it into the bounded backlog; only when the backlog is full are records dropped, counted (``dropped``,
``on_drop``: the server exports it as ``tailguard_store_dropped_records_total``) and logged. A batch that fails for
any other reason is retried one row at a time, so that one bad row loses only itself, as with SQLite.

A batch goes in with COPY, in one transaction with its queue samples and alerts. Every row carries a random
``write_key`` (UUID, unique): a commit whose acknowledgement was lost with the connection is retried as an INSERT
with ``ON CONFLICT (write_key) DO NOTHING``, which keeps it from being stored twice. Queue samples carry no key (a
repeated gauge sample costs nothing).

Retention runs in the database (``DELETE ... WHERE received_at < extract(epoch FROM now()) - ...``) at start and
every ``retention_interval`` seconds, by one gateway at a time (a try-lock). ``query`` takes the SQLite dialect the
callers already use (``?`` placeholders, a bare ``user`` column) and translates it.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict
except ImportError as exc:  # pragma: no cover - the server extra installs it
    raise ImportError("a postgresql:// request store needs psycopg 3: pip install 'psycopg[binary]>=3' "
                      "(or tailguard[server])") from exc

from tailguard.observe.store import (
    ALERT_COLUMNS,
    COLUMNS,
    SAMPLE_COLUMNS,
    SCHEMA_VERSION,
    SECRET_ENV,
    RequestStore,
    SchemaError,
    log,
    storable,
)

_META = "CREATE TABLE IF NOT EXISTS tailguard_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
# Column comments: see SQLITE_SCHEMA in store.py; the same columns, plus write_key; the columns schema 4 added come after
# it, where its migration puts them in a database of schema 3.
_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id TEXT NOT NULL,
    received_at DOUBLE PRECISION NOT NULL,
    endpoint TEXT NOT NULL,
    model TEXT,
    "user" TEXT,
    business_type TEXT,
    stream INTEGER NOT NULL,
    status INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    finish_reason TEXT,
    error TEXT,
    prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    e2e DOUBLE PRECISION NOT NULL,
    ttft DOUBLE PRECISION,
    tpot DOUBLE PRECISION,
    tokenize DOUBLE PRECISION NOT NULL,
    queue DOUBLE PRECISION NOT NULL,
    prefill DOUBLE PRECISION NOT NULL,
    decode DOUBLE PRECISION NOT NULL,
    stream_time DOUBLE PRECISION NOT NULL,
    record TEXT NOT NULL,
    prompt_text TEXT,
    output_text TEXT,
    prompt_token_ids TEXT,
    prompt_token_hmac TEXT,
    logprobs TEXT,
    lane TEXT,
    client TEXT,
    region TEXT,
    degraded INTEGER NOT NULL DEFAULT 0,
    slo_action TEXT,
    write_key UUID NOT NULL UNIQUE,
    internals TEXT
);
CREATE INDEX IF NOT EXISTS idx_requests_request_id ON requests(request_id);
CREATE INDEX IF NOT EXISTS idx_requests_received_at ON requests(received_at);
CREATE TABLE IF NOT EXISTS queue_samples (
    t DOUBLE PRECISION NOT NULL,
    running INTEGER NOT NULL,
    waiting INTEGER NOT NULL,
    server_queue INTEGER NOT NULL,
    kv_blocks_used INTEGER NOT NULL,
    kv_blocks_total INTEGER NOT NULL,
    cpu DOUBLE PRECISION,
    rss DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS idx_queue_samples_t ON queue_samples(t);
CREATE TABLE IF NOT EXISTS slo_alerts (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    event TEXT NOT NULL,
    scope TEXT,
    tier TEXT,
    at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    ended_at DOUBLE PRECISION,
    dry_run INTEGER NOT NULL,
    alert_id TEXT,
    figures TEXT NOT NULL,
    details TEXT NOT NULL,
    write_key UUID NOT NULL UNIQUE
);
CREATE INDEX IF NOT EXISTS idx_slo_alerts_at ON slo_alerts(at);
"""
# Schema N -> N+1 for databases written by an older tailguard (PostgreSQL support starts at schema 3). Columns are
# added at the end (after write_key): inserts name their columns, so the order does not matter.
_MIGRATIONS: dict[int, str] = {
    3: """
ALTER TABLE requests ADD COLUMN IF NOT EXISTS internals TEXT;
ALTER TABLE queue_samples ADD COLUMN IF NOT EXISTS cpu DOUBLE PRECISION;
ALTER TABLE queue_samples ADD COLUMN IF NOT EXISTS rss DOUBLE PRECISION;
""",
}


def _quote(col: str) -> str:
    return '"user"' if col == "user" else col


def _insert(table: str, columns: tuple[str, ...]) -> str:
    cols = [*map(_quote, columns), "write_key"]
    return (f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))}) "
            "ON CONFLICT (write_key) DO NOTHING")


_INSERT = _insert("requests", COLUMNS)
# A batch's first attempt: COPY, about a third cheaper per row than the INSERT (no conflict check needed: its keys
# are new). Any attempt after a failure uses the INSERT, in case the failed one did commit.
_COPY = f"COPY requests ({', '.join([*map(_quote, COLUMNS), 'write_key'])}) FROM STDIN"
_INSERT_ALERT = _insert("slo_alerts", ALERT_COLUMNS)
_INSERT_SAMPLE = (f"INSERT INTO queue_samples ({', '.join(SAMPLE_COLUMNS)}) "
                  f"VALUES ({', '.join(['%s'] * len(SAMPLE_COLUMNS))})")
_INSERT_OF = {"request": _INSERT, "alert": _INSERT_ALERT, "sample": _INSERT_SAMPLE}

# Advisory lock ids: creating the schema (every gateway at start) and the retention sweep (one gateway at a time).
_LOCK_SCHEMA = 0x7467_0001
_LOCK_RETENTION = 0x7467_0002
# Failures that say "the database, not this row": the connection (08), a rollback it may not repeat (40), resources
# (53: disk full, too many connections), operator intervention (57: shutdown, restart), system errors (58).
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")
_READ_ONLY = "25006"  # a standby after failover, until the client finds the new primary
_MAX_READERS = 4  # read connections per store (per gateway)
# libpq settings the store wants unless the URL says otherwise: give up connecting after 10 s, and notice a dead
# peer (a cut network sends no reset) within about 30 s instead of the kernel's 15 minutes.
_CONNECT_DEFAULTS = {"connect_timeout": "10", "application_name": "tailguard", "keepalives": "1",
                     "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3",
                     "tcp_user_timeout": "30000"}
_USER_WORD = re.compile(r'(?<![\w".])user(?![\w"])', re.IGNORECASE)


class StoreUnavailableError(ConnectionError):
    """The PostgreSQL request store could not be reached when it was opened."""


def redact_url(url: str) -> str:
    """The URL with its password masked, for logs and ``store.path``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def to_postgres_sql(sql: str) -> str:
    """A query in the SQLite dialect the callers use, for psycopg: ``?`` -> ``%s``, ``%`` -> ``%%``, and a bare
    ``user`` column quoted (unquoted, PostgreSQL reads it as CURRENT_USER and answers with the role name)."""
    parts = sql.split("'")
    for i, part in enumerate(parts):
        part = part.replace("%", "%%")
        if i % 2 == 0:  # outside string literals
            part = _USER_WORD.sub('"user"', part.replace("?", "%s"))
        parts[i] = part
    return "'".join(parts)


class Row:
    """A result row that reads like ``sqlite3.Row``: by column name and by index."""

    __slots__ = ("_values", "_index")

    def __init__(self, values: tuple, index: dict[str, int]) -> None:
        self._values = values
        self._index = index

    def __getitem__(self, key: int | str | slice) -> Any:
        return self._values[self._index[key]] if isinstance(key, str) else self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self._values)

    def keys(self) -> list[str]:
        return list(self._index)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._index, self._values))!r})"


def _row_factory(cursor: Any) -> Any:
    index = {c.name: i for i, c in enumerate(cursor.description or ())}
    return lambda values: Row(tuple(values), index)


def _transient(exc: BaseException, conn: Any) -> bool:
    if conn is None or conn.closed or conn.broken:
        return True
    state = getattr(exc, "sqlstate", None)
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state[:2] in _TRANSIENT_CLASSES or state == _READ_ONLY


def _clean_pg(value: Any) -> Any:
    """As SQLite's, and NUL characters (PostgreSQL text cannot hold them) become U+FFFD."""
    value = storable(value)
    if isinstance(value, str) and "\x00" in value:
        return value.replace("\x00", "\ufffd")
    return value


class _Writer:
    """The writer thread's connection, opened on first use and again after it broke."""

    def __init__(self, url: str, kwargs: dict[str, str]) -> None:
        self.url = url
        self.kwargs = kwargs
        self.conn: psycopg.Connection | None = None

    def connection(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.reset()
            self.conn = psycopg.connect(self.url, autocommit=True, **self.kwargs)
        return self.conn

    def reset(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is gone either way
                log.debug("closing a broken store connection", exc_info=True)
        self.conn = None


class PostgresStore(RequestStore):
    """The request store in a PostgreSQL database. ``open_store("postgresql://...")`` builds one."""

    _clean = staticmethod(_clean_pg)

    def _open_backend(self, target: str, secret: str | bytes | None) -> None:
        self._url = target
        self.path = redact_url(target)
        try:
            given = conninfo_to_dict(target)
        except psycopg.ProgrammingError as exc:
            raise ValueError(f"bad PostgreSQL URL {self.path}: {exc}") from exc
        self._conn_kwargs = {k: v for k, v in _CONNECT_DEFAULTS.items() if k not in given}
        self._idle_readers: list[psycopg.Connection] = []
        self._readers_lock = threading.Lock()
        self._readers_closed = False  # after close: reads still work, on connections closed after each query
        self._reader_slots = threading.BoundedSemaphore(_MAX_READERS)
        try:
            with psycopg.connect(target, autocommit=True, **self._conn_kwargs) as conn:
                self._key, self.schema_version = (self._read_schema(conn, secret) if self.read_only
                                                  else self._open_schema(conn, secret))
        except psycopg.OperationalError as exc:
            raise StoreUnavailableError(f"request store {self.path}: cannot connect: {exc}".strip()) from exc

    def _open_schema(self, conn: psycopg.Connection, secret: str | bytes | None) -> tuple[bytes, int]:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_SCHEMA,))
            conn.execute(_META)
            row = conn.execute("SELECT value FROM tailguard_meta WHERE name = 'schema_version'").fetchone()
            version = int(row[0]) if row else None
            if version is not None and version > SCHEMA_VERSION:
                raise SchemaError(f"{self.path} has schema version {version}; this tailguard understands up to "
                                  f"{SCHEMA_VERSION}")
            if version is None:
                if conn.execute("SELECT to_regclass('requests')").fetchone()[0] is not None:
                    raise SchemaError(f"{self.path} has a 'requests' table that tailguard did not create "
                                      "(no schema version in tailguard_meta); use another database or schema")
                conn.execute(_PG_SCHEMA)
                version = SCHEMA_VERSION
                conn.execute("INSERT INTO tailguard_meta VALUES ('schema_version', %s)", (str(version),))
            while version < SCHEMA_VERSION:
                if version not in _MIGRATIONS:
                    raise SchemaError(f"{self.path}: no migration from schema {version}")
                conn.execute(_MIGRATIONS[version])
                version += 1
                conn.execute("UPDATE tailguard_meta SET value = %s WHERE name = 'schema_version'", (str(version),))
                log.info("request store %s migrated to schema %d", self.path, version)
            return self._pseudonym_key(conn, secret), version

    def _read_schema(self, conn: psycopg.Connection, secret: str | bytes | None) -> tuple[bytes, int]:
        """A reader's check: the database holds a request store of this code's schema (nothing is created)."""
        if conn.execute("SELECT to_regclass('tailguard_meta')").fetchone()[0] is None:
            raise SchemaError(f"{self.path} holds no tailguard request store")
        meta = dict(conn.execute("SELECT name, value FROM tailguard_meta").fetchall())
        version = int(meta.get("schema_version", 0))
        if version != SCHEMA_VERSION:
            raise SchemaError(f"{self.path} has schema version {version}; this tailguard reads {SCHEMA_VERSION} "
                              "(a server started on it, `tailguard serve --store`, migrates it)")
        secret = secret or os.environ.get(SECRET_ENV)
        key = (secret.encode() if isinstance(secret, str) else bytes(secret)) if secret else \
            bytes.fromhex(meta.get("pseudonym_key") or os.urandom(32).hex())
        return key, version

    @staticmethod
    def _pseudonym_key(conn: psycopg.Connection, secret: str | bytes | None) -> bytes:
        """``secret``, else ``$TAILGUARD_STORE_SECRET``, else a random key kept in the database: every gateway that
        shares the database then pseudonymizes a user alike (set the secret to keep the key out of the database)."""
        if secret:
            return secret.encode() if isinstance(secret, str) else bytes(secret)
        if os.environ.get(SECRET_ENV):
            return os.environ[SECRET_ENV].encode()
        conn.execute("INSERT INTO tailguard_meta VALUES ('pseudonym_key', %s) ON CONFLICT (name) DO NOTHING",
                     (os.urandom(32).hex(),))
        return bytes.fromhex(conn.execute("SELECT value FROM tailguard_meta WHERE name = 'pseudonym_key'").fetchone()[0])

    # --- reads (any thread: a few pooled connections) --------------------------------------------------------------
    def _take_reader(self) -> psycopg.Connection:
        with self._readers_lock:
            while self._idle_readers:
                conn = self._idle_readers.pop()
                if not conn.closed and not conn.broken:
                    return conn
        return psycopg.connect(self._url, autocommit=True, row_factory=_row_factory, **self._conn_kwargs)

    def _give_back_reader(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.broken:
            return
        with self._readers_lock:
            if not self._readers_closed:
                self._idle_readers.append(conn)
                return
        conn.close()

    def query(self, sql: str, params: tuple = ()) -> list[Row]:
        """Rows of a read query written for SQLite (``?`` placeholders). At most ``_MAX_READERS`` run at once (the
        server reads from a thread pool; each would otherwise hold a connection of the database's limited number);
        a connection broken by a database restart is replaced and the query tried once more."""
        pg_sql = to_postgres_sql(sql)
        with self._reader_slots:
            conn = self._take_reader()
            try:
                return conn.execute(pg_sql, tuple(params)).fetchall()
            except psycopg.OperationalError:
                if not (conn.broken or conn.closed):
                    raise
            finally:
                self._give_back_reader(conn)
            # The database went away since this connection was made: so did the idle ones; start afresh.
            with self._readers_lock:
                stale, self._idle_readers = self._idle_readers, []
            for old in stale:
                old.close()
            conn = self._take_reader()
            try:
                return conn.execute(pg_sql, tuple(params)).fetchall()
            finally:
                self._give_back_reader(conn)

    def _close_readers(self) -> None:
        with self._readers_lock:
            idle, self._idle_readers = self._idle_readers, []
            self._readers_closed = True
        for conn in idle:
            try:
                conn.close()
            except Exception:  # noqa: BLE001
                log.debug("closing a reader connection", exc_info=True)

    # --- writer thread ------------------------------------------------------------------------------------------------
    def _open_writer(self) -> _Writer:
        return _Writer(self._url, self._conn_kwargs)

    def _close_writer(self, writer: _Writer) -> None:
        writer.reset()

    def enforce_retention(self, conn: Any = None, now: float | None = None) -> int:
        """Delete rows older than the retention period, in the database and by its clock (``now``: unix seconds, for
        tests); returns requests deleted, or 0 when another gateway is sweeping right now."""
        if isinstance(conn, _Writer):
            return self._retention(conn.connection(), now)
        with psycopg.connect(self._url, **self._conn_kwargs) as own:
            return self._retention(own, now)

    def _retention(self, conn: psycopg.Connection, now: float | None) -> int:
        keep_s = self.retention_days * 86400.0
        cutoff, params = ("extract(epoch FROM now()) - %s", (keep_s,)) if now is None else ("%s", (now - keep_s,))
        with conn.transaction():
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (_LOCK_RETENTION,)).fetchone()[0]:
                return 0
            deleted = conn.execute(f"DELETE FROM requests WHERE received_at < {cutoff}", params).rowcount
            conn.execute(f"DELETE FROM queue_samples WHERE t < {cutoff}", params)
            conn.execute(f"DELETE FROM slo_alerts WHERE at < {cutoff}", params)
        return deleted

    def _sweep(self, writer: _Writer) -> None:
        try:
            self.enforce_retention(writer)
        except psycopg.Error as exc:
            if not _transient(exc, writer.conn):
                log.exception("retention sweep failed")
                return
            writer.reset()  # the next batch reconnects (and holds its records while it cannot)
            log.warning("request store %s: retention sweep skipped, the database is unreachable: %s", self.path,
                        str(exc).strip())

    def _write(self, writer: _Writer, timelines: list, samples: list[tuple],
               alerts: list[dict[str, Any]] | None = None) -> bool:
        rows, alert_rows, bad = self._build_rows(timelines, alerts)
        # One key per record, fixed before the first attempt: a retried commit cannot store it twice.
        rows = [(*r, uuid.uuid4()) for r in rows]
        alert_rows = [(*r, uuid.uuid4()) for r in alert_rows]
        return self._write_held(writer, len(timelines) + len(alerts or ()), rows, alert_rows, samples, bad)

    # --- what _write_held asks of this backend ------------------------------------------------------------------
    _held_words = "the database is unreachable"

    def _commit(self, writer: _Writer, rows: list[tuple], samples: list[tuple], alert_rows: list[tuple],
                first_attempt: bool) -> None:
        conn = writer.connection()
        with conn.transaction(), conn.cursor() as cur:
            if rows and first_attempt:  # COPY is fastest, but cannot skip a row a lost commit already stored
                with cur.copy(_COPY) as copy:
                    for row in rows:
                        copy.write_row(row)
            elif rows:
                cur.executemany(_INSERT, rows)
            if samples:
                cur.executemany(_INSERT_SAMPLE, samples)
            if alert_rows:
                cur.executemany(_INSERT_ALERT, alert_rows)

    def _insert_one(self, writer: _Writer, kind: str, row: tuple) -> None:
        conn = writer.connection()
        with conn.transaction():
            conn.execute(_INSERT_OF[kind], row)

    def _transient(self, exc: BaseException, writer: _Writer) -> bool:
        return isinstance(exc, psycopg.Error) and _transient(exc, writer.conn)

    def _after_failure(self, writer: _Writer, transient: bool) -> None:
        if transient:
            writer.reset()  # the next attempt reconnects
