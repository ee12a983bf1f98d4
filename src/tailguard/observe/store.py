"""The request store: one row per request, written by a background batch writer, in SQLite or PostgreSQL.

``open_store(target)`` (observe/stores.py) picks the backend from ``target``: a file path (or ``sqlite:///path``)
gives the embedded SQLite store (:mod:`tailguard.observe.store_sqlite`, the default); a ``postgresql://`` URL gives
the PostgreSQL store (:mod:`tailguard.observe.store_pg`) that several gateways can share. Both keep the same schema
(version ``SCHEMA_VERSION``), the same rules and the same read API (``get``, ``query``, ``count``, ``alerts``).

The event loop only appends the finished Timeline to an in-memory queue (no I/O, no serialization, no lock held for
long); a writer thread turns records into rows, redacts text when text storage is on, and commits in batches. Rows
older than the retention period (15 days by default) are deleted at start and then periodically, by the database.
The schema is versioned; a store written by a newer tailguard is refused, not silently mangled.

Nothing is lost silently. The backlog is bounded (records and approximate bytes); when it is full, ``put`` drops the
record and counts it rather than blocking: ``put`` runs on the event loop that serves every stream, and stalling it
would turn a slow disk, an unreachable database or slow redaction into latency for every request in flight. ``close``
drains the backlog until it is empty or its deadline passes; whatever is refused after close or left at the deadline
is counted (``dropped``, ``on_drop``) and logged.

Pseudonyms: ``user`` and the prompt-token digest are HMAC-SHA256 under a per-deployment secret (``secret``, else
``$TAILGUARD_STORE_SECRET``, else a random key generated once and kept beside the SQLite file, or in the PostgreSQL
database so that every gateway sharing it agrees), so records can be grouped by user and matched against a replay, but
not reversed by guessing and hashing.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailguard.observe.redaction import mask_plain
from tailguard.observe.timeline import Timeline

log = logging.getLogger("tailguard.store")

# 2: lane/client/region/degraded/slo_action columns and the slo_alerts table.
# 3: user pseudonymized (HMAC), prompt_token_sha256 -> prompt_token_hmac (salted), logprobs never beside redactions.
# 4: requests.internals (sampled per-layer internals); queue_samples.cpu and .rss (the machine's window).
SCHEMA_VERSION = 4
DEFAULT_RETENTION_DAYS = 15.0
DEFAULT_MAX_BACKLOG = 100_000
DEFAULT_MAX_BACKLOG_BYTES = 256 * 1024 * 1024
DEFAULT_CLOSE_DEADLINE_S = 60.0
_STUCK_WRITER_GRACE_S = 10.0  # after the deadline, how long the batch in hand may still take
SECRET_ENV = "TAILGUARD_STORE_SECRET"
SECRET_FILE = "store.secret"  # beside the database, mode 0600


# The schema, in SQLite's dialect (store_pg.py translates the types for PostgreSQL).
SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    received_at REAL NOT NULL,          -- unix seconds, for retention and for humans
    endpoint TEXT NOT NULL,
    model TEXT,
    user TEXT,                          -- HMAC pseudonym of the user id (schema 3+), never the raw id
    business_type TEXT,
    stream INTEGER NOT NULL,
    status INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    finish_reason TEXT,
    error TEXT,
    prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    e2e REAL NOT NULL,                  -- seconds; the five stages below add up to it
    ttft REAL,
    tpot REAL,
    tokenize REAL NOT NULL,
    queue REAL NOT NULL,
    prefill REAL NOT NULL,
    decode REAL NOT NULL,
    stream_time REAL NOT NULL,
    record TEXT NOT NULL,               -- JSON: timestamps, per-token times, sampling, resource snapshot
    prompt_text TEXT,                   -- redacted; only with --store-text
    output_text TEXT,                   -- redacted; only with --store-text
    prompt_token_ids TEXT,              -- JSON; tokens of the redacted prompt; only with --store-text
    prompt_token_hmac TEXT,             -- HMAC of the real prompt tokens (matches a replay here, reversible nowhere)
    logprobs TEXT,                      -- JSON candidate set, when requested and text storage is on; ids are
                                        -- withheld when redaction changed the output (they would spell it out)
    lane TEXT,
    client TEXT,
    region TEXT,
    degraded INTEGER NOT NULL DEFAULT 0, -- 1: answered by the SLO monitor's degradation (template or truncated)
    slo_action TEXT,                    -- JSON: what the SLO monitor did to the request (shed, degrade), else NULL
    internals TEXT                      -- JSON: sampled per-layer timings and activation statistics, else NULL
);
CREATE INDEX IF NOT EXISTS idx_requests_request_id ON requests(request_id);
CREATE INDEX IF NOT EXISTS idx_requests_received_at ON requests(received_at);
CREATE TABLE IF NOT EXISTS queue_samples (
    t REAL NOT NULL,                    -- unix seconds
    running INTEGER NOT NULL,
    waiting INTEGER NOT NULL,
    server_queue INTEGER NOT NULL,
    kv_blocks_used INTEGER NOT NULL,
    kv_blocks_total INTEGER NOT NULL,
    cpu REAL,                           -- server process CPU cores busy, mean over the sampler's window (schema 4+)
    rss REAL                            -- server process resident bytes, peak over the window (schema 4+)
);
CREATE INDEX IF NOT EXISTS idx_queue_samples_t ON queue_samples(t);
CREATE TABLE IF NOT EXISTS slo_alerts (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL,                   -- one id per alert/action: its "raised"/"started" and "cleared"/"undone" rows
    kind TEXT NOT NULL,                 -- alert | action | hook | advisory | objective
    name TEXT NOT NULL,                 -- tier_red, scale_out, shed, degrade, p99_over_p50, e2e_p99 ...
    event TEXT NOT NULL,                -- raised | cleared | started | undone | ok | failed
    scope TEXT,
    tier TEXT,
    at REAL NOT NULL,                   -- unix seconds of this event
    started_at REAL,
    ended_at REAL,
    dry_run INTEGER NOT NULL,
    alert_id TEXT,                      -- for actions: the alert that caused them
    figures TEXT NOT NULL,              -- JSON: the numbers that triggered it (percentiles, thresholds, samples)
    details TEXT NOT NULL               -- JSON
);
CREATE INDEX IF NOT EXISTS idx_slo_alerts_at ON slo_alerts(at);
"""

ALERT_COLUMNS = ("id", "kind", "name", "event", "scope", "tier", "at", "started_at", "ended_at", "dry_run",
                  "alert_id", "figures", "details")
COLUMNS = (
    "request_id", "received_at", "endpoint", "model", "user", "business_type", "stream", "status", "outcome",
    "finish_reason", "error", "prompt_tokens", "output_tokens", "e2e", "ttft", "tpot", "tokenize", "queue", "prefill",
    "decode", "stream_time", "record", "prompt_text", "output_text", "prompt_token_ids", "prompt_token_hmac",
    "logprobs", "lane", "client", "region", "degraded", "slo_action", "internals",
)
SAMPLE_COLUMNS = ("t", "running", "waiting", "server_queue", "kv_blocks_used", "kv_blocks_total", "cpu", "rss")
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(target: str | os.PathLike) -> bool:
    return isinstance(target, str) and target.lower().startswith(POSTGRES_SCHEMES)


def check_store_target(target: str | os.PathLike) -> str:
    """``target`` as a string if it names a store this tailguard can open (a path, sqlite:///PATH or a postgresql://
    URL), else ValueError. Imports no backend (config validation calls it)."""
    text = str(target).strip()
    if not text:
        raise ValueError("the request store target is empty: give a file path or a postgresql:// URL")
    if "://" in text and not is_postgres_url(text) and not text.startswith("sqlite://"):
        scheme = text.split("://", 1)[0]
        raise ValueError(f"unsupported request store URL scheme {scheme!r}: use a file path, sqlite:///PATH or "
                         "postgresql://USER@HOST:PORT/DB")
    return text


def sqlite_path(target: str | os.PathLike) -> str:
    """A SQLite target as a path: ``sqlite:///abs/path`` and ``sqlite://rel/path`` lose their scheme."""
    text = str(target)
    return text[len("sqlite://"):] if text.startswith("sqlite://") else text


def storable(value: Any) -> Any:
    """Strings as SQLite can store them: lone surrogates (legal in JSON escapes, illegal in UTF-8) become '?'."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "replace").decode("utf-8")
    return value


class SchemaError(RuntimeError):
    """The database was written by a newer schema than this code understands."""


# --- pseudonyms ---------------------------------------------------------------------------------------------------
def load_secret(path: str, secret: str | bytes | None = None, create: bool = True) -> bytes:
    """The deployment's pseudonym key: ``secret``, else ``$TAILGUARD_STORE_SECRET``, else the key file beside the
    database (32 random bytes, created once with mode 0600). An in-memory store gets a key that lives with it; so
    does a reader (``create=False``) of a store that has no key file (it pseudonymizes nothing)."""
    if secret:
        return secret.encode() if isinstance(secret, str) else bytes(secret)
    env = os.environ.get(SECRET_ENV)
    if env:
        return env.encode()
    if path == ":memory:":
        return secrets.token_bytes(32)
    key_file = Path(path).expanduser().parent / SECRET_FILE
    for _ in range(50):
        try:
            text = key_file.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            key = secrets.token_bytes(32)
            if not create:
                return key
            try:
                fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue  # another process created it first: read theirs
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(key.hex() + "\n")
            log.info("request store: generated a pseudonym key in %s (keep it: user ids hash with it)", key_file)
            return key
        if text:
            return bytes.fromhex(text)
        time.sleep(0.01)  # created by another process an instant ago and not yet written
    raise RuntimeError(f"{key_file} exists but is empty; delete it or set {SECRET_ENV}")


def _mac(key: bytes, domain: bytes, data: bytes) -> str:
    return hmac.new(key, domain + b"\0" + data, hashlib.sha256).hexdigest()


def pseudonym(key: bytes, value: str | None) -> str | None:
    """A user id as stored: 32 hex digits of HMAC-SHA256, stable for one deployment's key, useless without it."""
    if value is None or value == "":
        return value
    return _mac(key, b"user", value.encode("utf-8", "surrogatepass"))[:32]


def prompt_tokens_mac(key: bytes, ids: list[int]) -> str:
    return _mac(key, b"prompt-tokens", json.dumps(list(ids), separators=(",", ":")).encode())


def withhold_ids(logprobs: list[dict]) -> list[dict]:
    """The candidate set without token ids: the probabilities stay (confidence, margins), the text cannot be rebuilt."""
    out = []
    for e in logprobs:
        top = e.get("top")
        out.append({"id": None, "logprob": e.get("logprob"),
                    "top": None if top is None else [[None, lp] for _, lp in top], "ids_withheld": True})
    return out


def _backlog_cost(kind: str, item: Any) -> int:
    """Approximate bytes a queued item holds (Python objects, not the row): enough to bound memory, cheap to compute."""
    if kind != "request":
        return 1024
    tl = item
    cost = 2048 + 64 * (len(tl.token_times) + len(tl.token_sent))
    for text in (tl.prompt_text, tl.output_text):
        if text:
            cost += 49 + 4 * len(text) if not text.isascii() else 49 + len(text)
    if tl.prompt_token_ids:
        cost += 40 * len(tl.prompt_token_ids)
    if tl.logprobs:
        cost += 400 * len(tl.logprobs)
    if tl.internals:
        cost += 1024 * len(tl.internals.get("steps", ()))
    return cost



def unstored_record(tl: Timeline, pseudonym: Callable[[str | None], str | None] | None = None,
                    clean_error: Callable[[str], str] = mask_plain) -> dict[str, Any]:
    """A record still in memory as a reader may see it: the user as ``pseudonym`` stores it (withheld where there is
    no store, so no pseudonym key), stop sequences withheld (their count kept), the error message cleaned as the
    store cleans it: all are client text."""
    rec = tl.to_record()
    rec["user"] = pseudonym(rec["user"]) if pseudonym is not None else None
    if rec.get("error"):
        rec["error"] = clean_error(rec["error"])
    rec["sampling"] = stops_kept(rec.get("sampling"), None)
    return rec


def stops_kept(sampling: dict[str, Any] | None,
               redact: Callable[[str | None], str | None] | None) -> dict[str, Any] | None:
    """Sampling parameters as a record keeps them: stop sequences are client text, redacted by ``redact`` (text
    storage on), else withheld, their count kept."""
    if not sampling or not sampling.get("stop"):
        return sampling
    stops = sampling["stop"]
    return {**sampling, "stop": [redact(x) for x in stops] if redact is not None else None, "stop_count": len(stops)}


# A batch the database cannot take for a reason of the moment (a lock, a full disk, an outage) is held and retried
# after this long, doubling up to the cap, until it goes in or the close deadline passes.
_HOLD_FIRST_S = 0.05
_HOLD_MAX_S = 2.0
_LOG_EVERY_S = 10.0  # one line per reason this often at most: a failing store must not flood the log
_NEVER = -1e9


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class RequestStore:
    """Background-batched, exactly-once request records. ``put`` never blocks and never raises.

    Every record is either written, or counted in ``dropped`` (backlog full, put after close, close deadline passed)
    or ``failed`` (a row the database refused), each reported through ``on_drop`` / ``on_error`` and the log.

    ``open_store(target, ...)`` (observe/stores.py) builds the backend that ``target`` names; the backends
    implement ``_open_backend``, ``query``, ``enforce_retention`` and the writer's ``_open_writer`` / ``_write`` /
    ``_close_writer``; everything else (the backlog, the writer loop, rows, pseudonyms, reads) is shared here.
    """

    path: str
    schema_version: int
    _key: bytes

    def __init__(
        self,
        path: str | os.PathLike,
        retention_days: float = DEFAULT_RETENTION_DAYS,
        store_text: bool = False,
        redact: Callable[[str | None], str | None] | None = None,
        encode: Callable[[str], list[int]] | None = None,
        batch_size: int = 512,
        flush_interval: float = 0.05,
        retention_interval: float = 600.0,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        max_backlog_bytes: int = DEFAULT_MAX_BACKLOG_BYTES,
        close_deadline_s: float = DEFAULT_CLOSE_DEADLINE_S,
        secret: str | bytes | None = None,
        decode: Callable[[list[int]], str] | None = None,
        on_error: Callable[[int], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
        read_only: bool = False,
    ) -> None:
        if store_text and redact is None:
            raise ValueError("text storage needs a redactor: prompts are never stored unredacted")
        self.retention_days = retention_days
        self.store_text = store_text
        self._redact = redact
        self._encode = encode
        self._decode = decode
        self._batch_size = batch_size
        self._flush_interval = flush_interval
        self._retention_interval = retention_interval
        self._max_backlog = max_backlog
        self._max_backlog_bytes = max_backlog_bytes
        self.close_deadline_s = close_deadline_s
        self._on_error = on_error
        self._on_drop = on_drop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # records put but not yet committed (or failed)
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._abandon = threading.Event()  # the close deadline passed: count what is left instead of writing it
        self._closed = False  # refusing records: closed, or the writer died
        self._close_called = False
        self.written = 0
        self.failed = 0
        # (request id, received_unix) of each record the writer is done with (committed, or failed and counted), for
        # the server's recent-records cache to let go of; bounded in case nothing reads it.
        self.settled: collections.deque[tuple[str, str | None, float]] = collections.deque(maxlen=65536)
        self.dropped = 0
        self.dropped_samples = 0
        self._drop_logged: dict[str, float] = {}
        self.outages = 0  # times the writer could not write (locked, full, unreachable) and held its batch
        self.retries = 0  # attempts made while it could not
        self._held_logged = _NEVER
        self._failure_logged: dict[str, float] = {}  # reason -> when a line about it was last logged
        self._failures_unlogged: dict[str, int] = {}  # reason -> failures since that line
        self._traceback_logged = _NEVER
        # A reader (replay, rebuild, hotspots) changes nothing: no schema written, no key created, no retention sweep
        # (which would delete what the server's own retention keeps), no writer; a store that is not there is an error.
        self.read_only = read_only
        # Sets path, _key and schema_version (creating or migrating the schema unless read-only); raises if the store
        # is unusable.
        self._open_backend(sqlite_path(path) if not is_postgres_url(path) else str(path), secret)
        self._thread: threading.Thread | None = None
        if read_only:
            self._closed = self._close_called = True  # takes no records
            return
        self._thread = threading.Thread(target=self._run, name="tailguard-store", daemon=True)
        self._thread.start()

    # --- what a backend provides ------------------------------------------------------------------------------------
    def _open_backend(self, target: str, secret: str | bytes | None) -> None:
        """Connect and set ``path``, ``_key`` and ``schema_version``; with ``self.read_only``, write nothing."""
        raise NotImplementedError

    def query(self, sql: str, params: tuple = ()) -> list[Any]:
        """Rows of a read-only SQL query with ``?`` placeholders; each row reads by column name and by index."""
        raise NotImplementedError

    def enforce_retention(self, conn: Any = None, now: float | None = None) -> int:
        """Delete records (and queue samples, alerts) older than the retention period; returns requests deleted."""
        raise NotImplementedError

    def _open_writer(self) -> Any:
        raise NotImplementedError

    def _close_writer(self, conn: Any) -> None:
        raise NotImplementedError

    def _write(self, conn: Any, timelines: list[Timeline], samples: list[tuple],
               alerts: list[dict[str, Any]] | None = None) -> bool:
        """Commit one batch; False when the close deadline abandoned it unwritten (``close`` then counts it)."""
        rows, alert_rows, bad = self._build_rows(timelines, alerts)
        return self._write_held(conn, len(timelines) + len(alerts or ()), rows, alert_rows, samples, bad)

    # What a backend provides for ``_write_held``: a batch's commit, one row's insert ("request", "alert" or
    # "sample"), whether an error is of the moment rather than a row's, and what to do after one.
    def _commit(self, conn: Any, rows: list[tuple], samples: list[tuple], alert_rows: list[tuple],
                first_attempt: bool) -> None:
        raise NotImplementedError

    def _insert_one(self, conn: Any, kind: str, row: tuple) -> None:
        raise NotImplementedError

    def _transient(self, exc: BaseException, conn: Any) -> bool:
        raise NotImplementedError

    def _after_failure(self, conn: Any, transient: bool) -> None:
        """Undo what a failed attempt left (a transaction still open, a broken connection)."""

    _held_words = "cannot write"  # how the log says why a batch is held

    def _write_held(self, conn: Any, records: int, rows: list[tuple], alert_rows: list[tuple],
                    samples: list[tuple], bad: int) -> bool:
        """Commit a batch of ``records`` (``bad`` of them could not even be made into rows). A failure of the moment
        (``_transient``) holds the batch and retries it with backoff, never dropping it, until it goes in or the close
        deadline passes (False: ``close`` counts the rest as lost); any other failure is a row's, and the batch is
        retried one row at a time so that a bad row loses only itself."""
        one_by_one: list[tuple[str, tuple]] | None = None  # set once a row error failed the batch
        settled = bad  # records of the batch done with: not even a row (bad), or written or failed one by one
        backoff, held_since, first = _HOLD_FIRST_S, None, True
        while True:
            try:
                if one_by_one is None:
                    self._commit(conn, rows, samples, alert_rows, first)
                    self.written += len(rows)
                else:
                    while one_by_one:
                        kind, row = one_by_one[0]
                        try:
                            self._insert_one(conn, kind, row)
                            self.written += kind == "request"
                        except Exception as exc:  # noqa: BLE001 - a bad row loses only itself
                            if self._transient(exc, conn):
                                raise  # not the row's fault: hold the rest of the batch
                            what = "queue sample" if kind == "sample" else "record"
                            self._log_failure(exc, what, f"{what} {row[0]} could not be written")
                            bad += kind != "sample"
                        one_by_one.pop(0)
                        settled += kind != "sample"
                break
            except Exception as exc:  # noqa: BLE001 - held and retried, or retried one row at a time
                first = False
                transient = self._transient(exc, conn)
                self._after_failure(conn, transient)
                if not transient:
                    self._log_failure(exc, "batch", f"a batch of {len(rows) + len(alert_rows)} records failed; "
                                                    "retrying one by one")
                    one_by_one = [*(("request", r) for r in rows), *(("alert", r) for r in alert_rows),
                                  *(("sample", r) for r in samples)]
                    continue
                if held_since is None:
                    held_since = time.monotonic()
                    self.outages += 1
                self.retries += 1
                self._log_held(exc, records - settled)
                if self._abandon.wait(backoff):
                    # The close deadline passed: what this batch settled is done; close() counts the rest as lost.
                    self._count_failed(bad)
                    self._done(settled, 0)
                    return False
                backoff = min(backoff * 2, _HOLD_MAX_S)
        if held_since is not None:
            log.warning("request store %s: writable again after %.1f s; the %d held records are written", self.path,
                        time.monotonic() - held_since, len(rows) + len(alert_rows))
            self._held_logged = _NEVER
        self._count_failed(bad)
        return True

    def _log_held(self, exc: BaseException, holding: int) -> None:
        now = time.monotonic()
        if now - self._held_logged < _LOG_EVERY_S:
            return
        self._held_logged = now
        log.warning("request store %s: %s (%s); holding %d records in hand and %d queued, retrying (records beyond "
                    "the backlog bound of %d are dropped and counted)", self.path, self._held_words, first_line(exc),
                    holding, max(0, self.backlog - holding), self._max_backlog)

    def _log_failure(self, exc: BaseException, what: str, message: str) -> None:
        """One line per reason (``what`` failed, and the kind of error) every 10 s at most, saying how many failures
        it stands for, and one traceback per period in all: a store that refuses every row would otherwise log a
        traceback per record."""
        reason = f"{what}: {type(exc).__name__}"
        now = time.monotonic()
        self._failures_unlogged[reason] = self._failures_unlogged.get(reason, 0) + 1
        if now - self._failure_logged.get(reason, _NEVER) < _LOG_EVERY_S:
            return
        self._failure_logged[reason] = now
        count = self._failures_unlogged.pop(reason)
        with_traceback = now - self._traceback_logged >= _LOG_EVERY_S
        if with_traceback:
            self._traceback_logged = now
        log.error("request store: %s: %s (%d %s failure(s) of this kind since the last such line)", message,
                  first_line(exc), count, what, exc_info=exc if with_traceback else None)

    def _close_readers(self) -> None:
        """Release read connections at close (a later read opens new ones)."""

    _clean = staticmethod(storable)  # how a value is made storable

    def pseudonym(self, user: str | None) -> str | None:
        """How ``user`` is stored (and so how to look a user's records up)."""
        return pseudonym(self._key, user)

    # --- event-loop side --------------------------------------------------------------------------------------------
    def put(self, timeline: Timeline) -> bool:
        """Queue a finished timeline for writing. O(1), no I/O; False (counted and logged) if the backlog is full or
        the store is closed."""
        return self._enqueue("request", timeline)

    def put_alert(self, record: dict[str, Any]) -> bool:
        """Queue one SLO alert/action record (a dict of :class:`tailguard.slo.actions.RecordLog`). Thread-safe."""
        return self._enqueue("alert", dict(record))

    def _enqueue(self, kind: str, item: Any) -> bool:
        cost = _backlog_cost(kind, item)
        with self._lock:
            if self._closed:
                reason = "the store is closed"
            elif self._pending >= self._max_backlog or (
                    self._pending and self._pending_bytes + cost > self._max_backlog_bytes):
                reason = "the backlog is full"
            else:
                self._pending += 1
                self._pending_bytes += cost
                self._q.put((kind, item, cost))
                return True
            self.dropped += 1
        self._report_drop(1, reason, item)
        return False

    def _report_drop(self, n: int, reason: str, item: Any = None) -> None:
        if self._on_drop:
            with contextlib.suppress(Exception):
                self._on_drop(n)
        # One line per reason every 10 s at most: a flood of drops must not become a flood of log lines.
        now = time.monotonic()
        if now - self._drop_logged.get(reason, -1e9) >= 10.0:
            self._drop_logged[reason] = now
            what = f"request {item.request_id}" if isinstance(item, Timeline) else f"{n} record(s)"
            log.error("request store: %s not written: %s (%d dropped so far; backlog %d records, ~%d MiB)", what,
                      reason, self.dropped, self._pending, self._pending_bytes >> 20)

    def put_sample(self, t: float, running: int, waiting: int, server_queue: int, kv_used: int, kv_total: int,
                   cpu: float | None = None, rss: float | None = None) -> bool:
        """One queue sample; ``cpu`` (cores, window mean) and ``rss`` (bytes, window peak) when the machine sampler
        runs."""
        with self._lock:
            if self._closed or self._pending >= self._max_backlog:
                self.dropped_samples += 1
                return False
            self._q.put(("sample", (t, running, waiting, server_queue, kv_used, kv_total, cpu, rss), 0))
        return True

    @property
    def backlog(self) -> int:
        return self._pending

    @property
    def backlog_bytes(self) -> int:
        """Approximate memory the backlog holds."""
        return self._pending_bytes

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every record put so far is committed (tests, shutdown). Call it off the event loop."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, deadline_s: float | None = None) -> int:
        """Stop taking records and write the backlog, for up to ``deadline_s`` (default ``close_deadline_s``).

        Returns how many records were not written (0 when everything got to disk); they are counted in ``dropped``,
        reported through ``on_drop`` and logged. A record put after close is refused and counted the same way.
        """
        deadline_s = self.close_deadline_s if deadline_s is None else deadline_s
        if self._thread is None:  # read-only: nothing to write
            self._close_readers()
            return 0
        with self._lock:
            if self._close_called:
                return 0
            self._close_called = True
            self._closed = True
            left = self._pending
            self._q.put(("stop", None, 0))
        if left:
            log.info("request store: writing the last %d records before exit (up to %.0f s)", left, deadline_s)
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            self._abandon.set()  # the writer stops after the batch in hand
            self._thread.join(_STUCK_WRITER_GRACE_S)
            if self._thread.is_alive():  # stuck inside one batch (a hung redaction, a locked file): give up on it
                log.error("request store: the writer is stuck in a batch; counting it as lost")
        with self._lock:  # the writer has exited: whatever is still pending was never written
            lost, self._pending, self._pending_bytes = self._pending, 0, 0
            self.dropped += lost
            self._idle.notify_all()
        if lost:
            self._report_drop(lost, "the close deadline passed")
            log.error("request store: %d records could not be written within the %.0f s close deadline",
                      lost, deadline_s)
        self._close_readers()
        return lost

    # --- reads (any thread) -----------------------------------------------------------------------------------------
    def get(self, request_id: str) -> dict[str, Any] | None:
        """The most recent record with this request id (ids from clients may repeat), or None."""
        rows = self.query("SELECT * FROM requests WHERE request_id = ? ORDER BY id DESC LIMIT 1", (request_id,))
        return row_to_record(rows[0]) if rows else None

    def get_owned(self, request_id: str, owner: str) -> dict[str, Any] | None:
        """The most recent record with this request id that ``owner`` (a client key's id) made, or None.

        Every row with the id is a candidate, however many other clients reused it: a client always finds its own.
        The owner sits in the record's JSON (written compactly, ``"owner":"<hex id>"``), matched in SQL alike on
        SQLite and PostgreSQL."""
        if not owner or not all(c in "0123456789abcdef" for c in owner):
            return None  # key ids are hex: anything else cannot be an owner (and never reaches the pattern)
        rows = self.query("SELECT * FROM requests WHERE request_id = ? AND record LIKE ? ORDER BY id DESC LIMIT 1",
                          (request_id, f'%"owner":"{owner}"%'))
        return row_to_record(rows[0]) if rows else None

    def count(self) -> int:
        return self.query("SELECT COUNT(*) FROM requests")[0][0]

    def alerts(self, limit: int = 100, since: float | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        """The most recent ``limit`` SLO alert/action records (oldest first), optionally since a unix time."""
        where, params = [], []
        if since is not None:
            where.append("at >= ?")
            params.append(since)
        if kind is not None:
            where.append("kind = ?")
            params.append(kind)
        sql = "SELECT * FROM slo_alerts" + (f" WHERE {' AND '.join(where)}" if where else "")
        rows = self.query(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit))
        return [alert_row_to_record(r) for r in reversed(rows)]

    # --- writer thread ------------------------------------------------------------------------------------------------
    def _logprobs(self, tl: Timeline, output_text: str | None) -> str | None:
        """The candidate set as stored: token ids only where the text they spell needed no redaction."""
        lps = tl.logprobs
        if self._decode is not None:
            spelled = self._decode([e["id"] for e in lps])
            clean = self._redact(spelled) == spelled
        else:
            # Without a decoder, judge by the output text; none recorded (an aborted stream): assume the worst.
            clean = tl.output_text is not None and output_text == tl.output_text
        return json.dumps(lps if clean else withhold_ids(lps), ensure_ascii=False, separators=(",", ":"))

    def record_of(self, tl: Timeline) -> dict[str, Any]:
        """A timeline not yet written, as ``get`` will return it without its text: the user pseudonymized, stop
        sequences withheld. Serve this (or ``unstored_record``), never ``tl.to_record()``, for records in memory."""
        return unstored_record(tl, self.pseudonym, self.clean_error)

    def clean_error(self, error: str) -> str:
        """A record's error message as stored: it may quote what the client sent (a model name, a field name), so
        it is redacted like text where text is stored, else masked by the finders that need no extra."""
        cleaned = self._redact(error) if self._redact is not None else mask_plain(error)
        return cleaned if cleaned is not None else error

    def _row(self, tl: Timeline) -> tuple:
        rec = tl.to_record()
        s = rec["stages"]
        prompt_text = output_text = token_ids = token_mac = logprobs = None
        if self.store_text:
            assert self._redact is not None
            prompt_text = self._redact(tl.prompt_text)
            output_text = self._redact(tl.output_text)
            if tl.prompt_token_ids is not None:
                token_mac = prompt_tokens_mac(self._key, tl.prompt_token_ids)
                # The real ids would spell out what redaction removed: keep the tokens of the redacted prompt.
                if prompt_text is not None and self._encode is not None:
                    ids = tl.prompt_token_ids if prompt_text == tl.prompt_text else self._encode(prompt_text)
                    token_ids = json.dumps(ids, separators=(",", ":"))
            if tl.logprobs is not None:
                logprobs = self._logprobs(tl, output_text)
        body = {k: rec[k] for k in ("timestamps", "token_times", "token_sent", "resources", "preemptions", "owner")}
        if rec.get("cached_prompt_tokens"):
            body["cached_prompt_tokens"] = rec["cached_prompt_tokens"]
        if self.store_text and tl.prompt_text is not None:
            body["prompt_redacted"] = prompt_text != tl.prompt_text  # a replay says it sends the redacted text
        # Tenant, lane wait, replica...; speculative guesses and acceptance; the client connection's quality.
        for extra in ("gateway", "speculation", "network", "interrupted", "upload", "client_wait", "client_waits"):
            if rec.get(extra):
                body[extra] = rec[extra]
        body["sampling"] = stops_kept(rec["sampling"], self._redact if self.store_text else None)
        if tl.sealed is not None:  # encrypted token ids for a rebuild (observe/sealing.py)
            try:
                body["sealed"] = tl.sealed()
            except Exception:  # noqa: BLE001 - a seal that fails loses the rebuild, never the record
                log.exception("sealing request %s failed", tl.request_id)
        action = json.dumps(tl.slo_action, separators=(",", ":")) if tl.slo_action else None
        internals = json.dumps(tl.internals, separators=(",", ":")) if tl.internals is not None else None
        return tuple(self._clean(v) for v in (
            rec["request_id"], rec["received_at"], rec["endpoint"], rec["model"], self.pseudonym(rec["user"]),
            rec["business_type"], int(rec["stream"]), rec["status"], rec["outcome"] or "unknown",
            rec["finish_reason"], self.clean_error(rec["error"]) if rec["error"] else None, rec["prompt_tokens"], rec["output_tokens"], rec["e2e"], rec["ttft"],
            rec["tpot"], s["tokenize"], s["queue"], s["prefill"], s["decode"], s["stream"],
            json.dumps(body, ensure_ascii=False, separators=(",", ":")),
            prompt_text, output_text, token_ids, token_mac, logprobs, rec["lane"], rec["client"], rec["region"],
            int(rec["degraded"]), action, internals,
        ))

    def _alert_row(self, r: dict[str, Any]) -> tuple:
        return tuple(self._clean(v) for v in (
            str(r["id"]), r["kind"], r["name"], r["event"], r.get("scope"), r.get("tier"), float(r["at"]),
            r.get("started_at"), r.get("ended_at"), int(bool(r.get("dry_run"))), r.get("alert_id"),
            json.dumps(r.get("figures") or {}, default=str, separators=(",", ":")),
            json.dumps(r.get("details") or {}, default=str, separators=(",", ":")),
        ))

    def _build_rows(self, timelines: list[Timeline], alerts: list[dict[str, Any]] | None) -> tuple[
            list[tuple], list[tuple], int]:
        """The rows of a batch, and how many records could not even be made into one (each loses only itself)."""
        rows, alert_rows, bad = [], [], 0
        for a in alerts or ():
            try:
                alert_rows.append(self._alert_row(a))
            except Exception:  # noqa: BLE001 - a malformed record loses only itself
                log.exception("could not build an SLO alert row")
                bad += 1
        for tl in timelines:
            try:
                rows.append(self._row(tl))
            except Exception:  # noqa: BLE001 - one bad record must not take the batch down
                log.exception("could not build the record of request %s", getattr(tl, "request_id", "?"))
                bad += 1
        return rows, alert_rows, bad

    def _count_failed(self, bad: int) -> None:
        if bad:
            self.failed += bad
            if self._on_error:
                self._on_error(bad)

    def _done(self, n: int, nbytes: int) -> None:
        with self._idle:
            self._pending = max(0, self._pending - n)
            self._pending_bytes = max(0, self._pending_bytes - nbytes)
            if self._pending == 0:
                self._pending_bytes = 0
                self._idle.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("request store: the writer thread died; records from now on are counted as dropped")
            with self._lock:
                self._closed = True  # refuse (and count) new records rather than queue them for nobody

    def _sweep(self, conn: Any) -> None:
        try:
            self.enforce_retention(conn)
        except Exception:  # noqa: BLE001 - the next sweep tries again
            log.exception("retention sweep failed")

    def _loop(self) -> None:
        conn = self._open_writer()
        try:
            self._sweep(conn)
            self._drain(conn)
        finally:
            self._close_writer(conn)

    def _drain(self, conn: Any) -> None:
        next_sweep = time.monotonic() + self._retention_interval
        stopping = False
        while not stopping:
            if self._abandon.is_set():
                break
            try:
                kind, item, cost = self._q.get(timeout=min(1.0, self._retention_interval))
            except queue.Empty:
                kind, item, cost = None, None, 0
            timelines: list[Timeline] = []
            samples: list[tuple] = []
            alerts: list[dict[str, Any]] = []
            nbytes = 0
            deadline = time.monotonic() + self._flush_interval
            slept = False
            while kind is not None:
                nbytes += cost
                if kind == "request":
                    timelines.append(item)
                elif kind == "sample":
                    samples.append(item)
                elif kind == "alert":
                    alerts.append(item)
                else:
                    stopping = True
                if len(timelines) >= self._batch_size or stopping:
                    break
                # Gather what arrives within the flush interval into one transaction, sleeping it out rather than
                # waiting on the queue: a waiting reader is woken by every put, and each wake-up takes the GIL from
                # the event loop for a moment (at 66 records/s that was 66 forced switches a second; now 1 per batch).
                try:
                    kind, item, cost = self._q.get_nowait()
                except queue.Empty:
                    left = deadline - time.monotonic()
                    if slept or left <= 0:
                        break
                    time.sleep(left)
                    slept = True
                    try:
                        kind, item, cost = self._q.get_nowait()
                    except queue.Empty:
                        break
            if timelines or samples or alerts:
                try:
                    finished = self._write(conn, timelines, samples, alerts)
                except Exception:  # noqa: BLE001 - the writer thread must outlive any bad batch
                    log.exception("request store: a batch of %d records lost", len(timelines) + len(alerts))
                    self._count_failed(len(timelines) + len(alerts))
                    finished = True
                if not finished:
                    break  # abandoned at the close deadline: close() counts the batch in hand with the rest
                self.settled.extend((tl.request_id, tl.owner, tl.received_unix) for tl in timelines)
                self._done(len(timelines) + len(alerts), nbytes)
            if time.monotonic() >= next_sweep and not stopping:
                self._sweep(conn)
                next_sweep = time.monotonic() + self._retention_interval


def row_to_record(row: Any) -> dict[str, Any]:
    """A stored row as the API's record (the shape of ``Timeline.to_record`` plus the text audit fields)."""
    body = json.loads(row["record"])
    rec: dict[str, Any] = {
        "request_id": row["request_id"],
        "received_at": row["received_at"],
        "endpoint": row["endpoint"],
        "model": row["model"],
        "user": row["user"],
        "owner": body.get("owner"),
        "business_type": row["business_type"],
        "stream": bool(row["stream"]),
        "status": row["status"],
        "outcome": row["outcome"],
        "finish_reason": row["finish_reason"],
        "error": row["error"],
        "prompt_tokens": row["prompt_tokens"],
        "output_tokens": row["output_tokens"],
        "preemptions": body.get("preemptions", 0),
        "upload": body.get("upload", 0.0),
        "e2e": row["e2e"],
        "ttft": row["ttft"],
        "tpot": row["tpot"],
        "stages": {"tokenize": row["tokenize"], "queue": row["queue"], "prefill": row["prefill"],
                   "decode": row["decode"], "stream": row["stream_time"]},
        "timestamps": body.get("timestamps"),
        "token_times": body.get("token_times", []),
        "token_sent": body.get("token_sent", []),
        "sampling": body.get("sampling"),
        "resources": body.get("resources"),
        "lane": row["lane"] or "default",
        "client": row["client"] or "default",
        "region": row["region"] or "default",
        "degraded": bool(row["degraded"]),
        "slo_action": json.loads(row["slo_action"]) if row["slo_action"] else None,
        "gateway": body.get("gateway"),
        "speculation": body.get("speculation"),
        "network": body.get("network"),
        "cached_prompt_tokens": body.get("cached_prompt_tokens", 0),
    }
    if body.get("sealed"):
        rec["sealed"] = body["sealed"]
    if body.get("interrupted"):
        rec["interrupted"] = True
    if body.get("client_wait"):  # the answer waited for the client to read (on no figure's clock)
        rec["client_wait"] = body["client_wait"]
        rec["client_waits"] = body.get("client_waits", [])
    internals = row["internals"]
    if internals:
        rec["internals"] = json.loads(internals)
    if "prompt_redacted" in body:
        rec["prompt_redacted"] = body["prompt_redacted"]
    if any(row[k] is not None for k in ("prompt_text", "output_text", "prompt_token_ids", "logprobs")):
        rec["prompt_text"] = row["prompt_text"]
        rec["output_text"] = row["output_text"]
        rec["prompt_token_ids"] = json.loads(row["prompt_token_ids"]) if row["prompt_token_ids"] else None
        rec["prompt_token_hmac"] = row["prompt_token_hmac"]
        rec["logprobs"] = json.loads(row["logprobs"]) if row["logprobs"] else None
    return rec


def alert_row_to_record(row: Any) -> dict[str, Any]:
    """A stored SLO alert/action row as the dict the monitor emitted."""
    rec = {k: row[k] for k in ALERT_COLUMNS}
    rec["dry_run"] = bool(rec["dry_run"])
    rec["figures"] = json.loads(rec["figures"])
    rec["details"] = json.loads(rec["details"])
    return rec
