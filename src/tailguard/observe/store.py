"""The request store: one SQLite (WAL) row per request, written by a background batch writer.

The event loop only appends the finished Timeline to an in-memory queue (no I/O, no serialization, no lock held for
long); a writer thread turns records into rows, redacts text when text storage is on, and commits in batches. Rows
older than the retention period (15 days by default) are deleted at start and then periodically. The schema is
versioned with ``PRAGMA user_version``; a store written by a newer tailguard is refused, not silently mangled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailguard.observe.timeline import Timeline

log = logging.getLogger("tailguard.store")

SCHEMA_VERSION = 2  # 2: lane/client/region/degraded/slo_action columns and the slo_alerts table
DEFAULT_RETENTION_DAYS = 15.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    received_at REAL NOT NULL,          -- unix seconds, for retention and for humans
    endpoint TEXT NOT NULL,
    model TEXT,
    user TEXT,
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
    prompt_token_sha256 TEXT,           -- hash of the real prompt tokens (matches a replay without keeping PII)
    logprobs TEXT,                      -- JSON candidate set (T3), when requested and text storage is on
    lane TEXT,
    client TEXT,
    region TEXT,
    degraded INTEGER NOT NULL DEFAULT 0, -- 1: answered by the SLO monitor's degradation (template or truncated)
    slo_action TEXT                     -- JSON: what the SLO monitor did to the request (shed, degrade), else NULL
);
CREATE INDEX IF NOT EXISTS idx_requests_request_id ON requests(request_id);
CREATE INDEX IF NOT EXISTS idx_requests_received_at ON requests(received_at);
CREATE TABLE IF NOT EXISTS queue_samples (
    t REAL NOT NULL,                    -- unix seconds
    running INTEGER NOT NULL,
    waiting INTEGER NOT NULL,
    server_queue INTEGER NOT NULL,
    kv_blocks_used INTEGER NOT NULL,
    kv_blocks_total INTEGER NOT NULL
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

# Columns added after schema version 1, for files written by an older tailguard.
_ADDED_COLUMNS = (
    ("lane", "TEXT"), ("client", "TEXT"), ("region", "TEXT"), ("degraded", "INTEGER NOT NULL DEFAULT 0"),
    ("slo_action", "TEXT"),
)
_ALERT_COLUMNS = ("id", "kind", "name", "event", "scope", "tier", "at", "started_at", "ended_at", "dry_run",
                  "alert_id", "figures", "details")
_INSERT_ALERT = f"INSERT INTO slo_alerts ({', '.join(_ALERT_COLUMNS)}) VALUES ({', '.join('?' * len(_ALERT_COLUMNS))})"

_COLUMNS = (
    "request_id", "received_at", "endpoint", "model", "user", "business_type", "stream", "status", "outcome",
    "finish_reason", "error", "prompt_tokens", "output_tokens", "e2e", "ttft", "tpot", "tokenize", "queue", "prefill",
    "decode", "stream_time", "record", "prompt_text", "output_text", "prompt_token_ids", "prompt_token_sha256",
    "logprobs", "lane", "client", "region", "degraded", "slo_action",
)
_INSERT = f"INSERT INTO requests ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


def _safe(value: Any) -> Any:
    """Strings as SQLite can store them: lone surrogates (legal in JSON escapes, illegal in UTF-8) become '?'."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "replace").decode("utf-8")
    return value


class SchemaError(RuntimeError):
    """The database was written by a newer schema than this code understands."""


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def open_schema(path: str) -> int:
    """Create or check the schema; returns the version in the file."""
    conn = _connect(path)
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() != "wal" and path != ":memory:":
            log.warning("SQLite refused WAL mode (%s); writes may block readers", mode)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaError(f"{path} has schema version {version}; this tailguard understands up to {SCHEMA_VERSION}")
        conn.executescript(_SCHEMA)
        have = {r[1] for r in conn.execute("PRAGMA table_info(requests)")}
        for name, decl in _ADDED_COLUMNS:  # version 1 -> 2
            if name not in have:
                conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {decl}")
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return SCHEMA_VERSION
    finally:
        conn.close()


class RequestStore:
    """Background-batched, exactly-once request records. ``put`` never blocks and never raises."""

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
        max_backlog: int = 200_000,
        on_error: Callable[[int], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        if store_text and redact is None:
            raise ValueError("text storage needs a redactor: prompts are never stored unredacted")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.retention_days = retention_days
        self.store_text = store_text
        self._redact = redact
        self._encode = encode
        self._batch_size = batch_size
        self._flush_interval = flush_interval
        self._retention_interval = retention_interval
        self._max_backlog = max_backlog
        self._on_error = on_error
        self._on_drop = on_drop
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # records put but not yet committed (or failed)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stop = threading.Event()
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self.schema_version = open_schema(self.path)
        self._reader_local = threading.local()
        self._thread = threading.Thread(target=self._run, name="tailguard-store", daemon=True)
        self._thread.start()

    # --- event-loop side --------------------------------------------------------------------------------------------
    def put(self, timeline: Timeline) -> bool:
        """Queue a finished timeline for writing. O(1), no I/O; False (and counted) only if the backlog is full."""
        return self._enqueue("request", timeline)

    def put_alert(self, record: dict[str, Any]) -> bool:
        """Queue one SLO alert/action record (a dict of :class:`tailguard.slo.actions.RecordLog`). Thread-safe."""
        return self._enqueue("alert", dict(record))

    def _enqueue(self, kind: str, item: Any) -> bool:
        with self._lock:
            if self._pending >= self._max_backlog:
                self.dropped += 1
                if self._on_drop:
                    self._on_drop(1)
                return False
            self._pending += 1
        self._q.put((kind, item))
        return True

    def put_sample(self, t: float, running: int, waiting: int, server_queue: int, kv_used: int, kv_total: int) -> None:
        self._q.put(("sample", (t, running, waiting, server_queue, kv_used, kv_total)))

    @property
    def backlog(self) -> int:
        return self._pending

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

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        self._stop.set()
        self._q.put(("stop", None))
        self._thread.join(timeout)

    # --- reads (any thread; WAL lets them run beside the writer) ----------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._reader_local, "conn", None)
        if conn is None:
            conn = _connect(self.path)
            conn.row_factory = sqlite3.Row
            self._reader_local.conn = conn
        return conn

    def get(self, request_id: str) -> dict[str, Any] | None:
        """The most recent record with this request id (ids from clients may repeat), or None."""
        row = self._reader().execute(
            "SELECT * FROM requests WHERE request_id = ? ORDER BY id DESC LIMIT 1", (request_id,)
        ).fetchone()
        return None if row is None else row_to_record(row)

    def query(self, sql: str, params: tuple = ()) -> list[sqlite3.Row]:
        return self._reader().execute(sql, params).fetchall()

    def count(self) -> int:
        return self._reader().execute("SELECT COUNT(*) FROM requests").fetchone()[0]

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
        rows = self._reader().execute(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit)).fetchall()
        return [alert_row_to_record(r) for r in reversed(rows)]

    # --- writer thread ------------------------------------------------------------------------------------------------
    def _row(self, tl: Timeline) -> tuple:
        rec = tl.to_record()
        s = rec["stages"]
        prompt_text = output_text = token_ids = token_hash = logprobs = None
        if self.store_text:
            assert self._redact is not None
            prompt_text = self._redact(tl.prompt_text)
            output_text = self._redact(tl.output_text)
            if tl.prompt_token_ids is not None:
                token_hash = hashlib.sha256(json.dumps(tl.prompt_token_ids).encode()).hexdigest()
                # The real ids would spell out what redaction removed: keep the tokens of the redacted prompt.
                if prompt_text is not None and self._encode is not None:
                    ids = tl.prompt_token_ids if prompt_text == tl.prompt_text else self._encode(prompt_text)
                    token_ids = json.dumps(ids, separators=(",", ":"))
            if tl.logprobs is not None:
                logprobs = json.dumps(tl.logprobs, ensure_ascii=False, separators=(",", ":"))
        body = {k: rec[k] for k in ("timestamps", "token_times", "token_sent", "sampling", "resources",
                                    "preemptions", "owner")}
        action = json.dumps(tl.slo_action, separators=(",", ":")) if tl.slo_action else None
        return tuple(_safe(v) for v in (
            rec["request_id"], rec["received_at"], rec["endpoint"], rec["model"], rec["user"], rec["business_type"],
            int(rec["stream"]), rec["status"], rec["outcome"] or "unknown", rec["finish_reason"], rec["error"],
            rec["prompt_tokens"], rec["output_tokens"], rec["e2e"], rec["ttft"], rec["tpot"], s["tokenize"],
            s["queue"], s["prefill"], s["decode"], s["stream"],
            json.dumps(body, ensure_ascii=False, separators=(",", ":")),
            prompt_text, output_text, token_ids, token_hash, logprobs, rec["lane"], rec["client"], rec["region"],
            int(rec["degraded"]), action,
        ))

    @staticmethod
    def _alert_row(r: dict[str, Any]) -> tuple:
        return tuple(_safe(v) for v in (
            str(r["id"]), r["kind"], r["name"], r["event"], r.get("scope"), r.get("tier"), float(r["at"]),
            r.get("started_at"), r.get("ended_at"), int(bool(r.get("dry_run"))), r.get("alert_id"),
            json.dumps(r.get("figures") or {}, default=str, separators=(",", ":")),
            json.dumps(r.get("details") or {}, default=str, separators=(",", ":")),
        ))

    def enforce_retention(self, conn: sqlite3.Connection | None = None, now: float | None = None) -> int:
        """Delete records (and queue samples) older than the retention period; returns rows deleted."""
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

    def _write(self, conn: sqlite3.Connection, timelines: list[Timeline], samples: list[tuple],
               alerts: list[dict[str, Any]] | None = None) -> None:
        rows, bad = [], 0
        alert_rows = []
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
        try:
            conn.execute("BEGIN")
            conn.executemany(_INSERT, rows)
            if samples:
                conn.executemany("INSERT INTO queue_samples VALUES (?, ?, ?, ?, ?, ?)", samples)
            if alert_rows:
                conn.executemany(_INSERT_ALERT, alert_rows)
            conn.execute("COMMIT")
            self.written += len(rows)
        except Exception:  # noqa: BLE001 - retry one by one so a single bad row loses only itself
            log.exception("request store: a batch of %d records failed; retrying one by one", len(rows))
            self._rollback(conn)
            for sql, row in [*((_INSERT, r) for r in rows), *((_INSERT_ALERT, r) for r in alert_rows)]:
                try:
                    conn.execute(sql, row)
                    if sql is _INSERT:
                        self.written += 1
                except Exception:  # noqa: BLE001
                    log.exception("request store: record %s could not be written", row[0])
                    bad += 1
        if bad:
            self.failed += bad
            if self._on_error:
                self._on_error(bad)
        with self._idle:
            self._pending -= len(timelines) + len(alerts or ())
            if self._pending <= 0:
                self._pending = 0
                self._idle.notify_all()

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")

    def _run(self) -> None:
        conn = _connect(self.path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; a crash may lose the last batch only
        try:
            self.enforce_retention(conn)
        except sqlite3.Error:
            log.exception("retention sweep failed")
        next_sweep = time.monotonic() + self._retention_interval
        stopping = False
        while not stopping:
            try:
                kind, item = self._q.get(timeout=min(1.0, self._retention_interval))
            except queue.Empty:
                kind, item = None, None
            timelines: list[Timeline] = []
            samples: list[tuple] = []
            alerts: list[dict[str, Any]] = []
            deadline = time.monotonic() + self._flush_interval
            while kind is not None:
                if kind == "request":
                    timelines.append(item)
                elif kind == "sample":
                    samples.append(item)
                elif kind == "alert":
                    alerts.append(item)
                else:
                    stopping = True
                if len(timelines) >= self._batch_size:
                    break
                try:
                    # Gather what arrives within the flush interval into one transaction.
                    left = deadline - time.monotonic()
                    kind, item = self._q.get(timeout=left) if left > 0 and not stopping else self._q.get_nowait()
                except queue.Empty:
                    break
            if timelines or samples or alerts:
                try:
                    self._write(conn, timelines, samples, alerts)
                except Exception:  # noqa: BLE001 - the writer thread must outlive any bad batch
                    log.exception("request store: batch lost")
                    with self._idle:
                        self._pending = max(0, self._pending - len(timelines) - len(alerts))
                        self._idle.notify_all()
            if time.monotonic() >= next_sweep:
                try:
                    self.enforce_retention(conn)
                except sqlite3.Error:
                    log.exception("retention sweep failed")
                next_sweep = time.monotonic() + self._retention_interval
        conn.close()


def row_to_record(row: sqlite3.Row) -> dict[str, Any]:
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
    }
    if row["prompt_text"] is not None or row["output_text"] is not None:
        rec["prompt_text"] = row["prompt_text"]
        rec["output_text"] = row["output_text"]
        rec["prompt_token_ids"] = json.loads(row["prompt_token_ids"]) if row["prompt_token_ids"] else None
        rec["prompt_token_sha256"] = row["prompt_token_sha256"]
        rec["logprobs"] = json.loads(row["logprobs"]) if row["logprobs"] else None
    return rec


def alert_row_to_record(row: sqlite3.Row) -> dict[str, Any]:
    """A stored SLO alert/action row as the dict the monitor emitted."""
    rec = {k: row[k] for k in _ALERT_COLUMNS}
    rec["dry_run"] = bool(rec["dry_run"])
    rec["figures"] = json.loads(rec["figures"])
    rec["details"] = json.loads(rec["details"])
    return rec
