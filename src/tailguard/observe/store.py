"""The request store: one SQLite (WAL) row per request, written by a background batch writer.

The event loop only appends the finished Timeline to an in-memory queue (no I/O, no serialization, no lock held for
long); a writer thread turns records into rows, redacts text when text storage is on, and commits in batches. Rows
older than the retention period (15 days by default) are deleted at start and then periodically. The schema is
versioned with ``PRAGMA user_version``; a store written by a newer tailguard is refused, not silently mangled.

Nothing is lost silently. The backlog is bounded (records and approximate bytes); when it is full, ``put`` drops the
record and counts it rather than blocking: ``put`` runs on the event loop that serves every stream, and stalling it
would turn a slow disk or slow redaction into latency for every request in flight. ``close`` drains the backlog until
it is empty or its deadline passes; whatever is refused after close or left at the deadline is counted (``dropped``,
``on_drop``) and logged.

Pseudonyms: ``user`` and the prompt-token digest are HMAC-SHA256 under a per-deployment secret (``secret``, else
``$TAILGUARD_STORE_SECRET``, else a random key generated once and kept beside the database), so records can be grouped
by user and matched against a replay, but not reversed by guessing and hashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tailguard.observe.timeline import Timeline

log = logging.getLogger("tailguard.store")

# 2: lane/client/region/degraded/slo_action columns and the slo_alerts table.
# 3: user pseudonymized (HMAC), prompt_token_sha256 -> prompt_token_hmac (salted), logprobs never beside redactions.
SCHEMA_VERSION = 3
DEFAULT_RETENTION_DAYS = 15.0
DEFAULT_MAX_BACKLOG = 100_000
DEFAULT_MAX_BACKLOG_BYTES = 256 * 1024 * 1024
DEFAULT_CLOSE_DEADLINE_S = 60.0
_STUCK_WRITER_GRACE_S = 10.0  # after the deadline, how long the batch in hand may still take
SECRET_ENV = "TAILGUARD_STORE_SECRET"
SECRET_FILE = "store.secret"  # beside the database, mode 0600

_SCHEMA = """
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
    logprobs TEXT,                      -- JSON candidate set (T3), when requested and text storage is on; ids are
                                        -- withheld when redaction changed the output (they would spell it out)
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
    "decode", "stream_time", "record", "prompt_text", "output_text", "prompt_token_ids", "prompt_token_hmac",
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


# --- pseudonyms ---------------------------------------------------------------------------------------------------
def load_secret(path: str, secret: str | bytes | None = None) -> bytes:
    """The deployment's pseudonym key: ``secret``, else ``$TAILGUARD_STORE_SECRET``, else the key file beside the
    database (32 random bytes, created once with mode 0600). An in-memory store gets a key that lives with it."""
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


# --- schema ---------------------------------------------------------------------------------------------------------
def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=10, check_same_thread=False, isolation_level=None)
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
        conn.executescript(_SCHEMA)  # idempotent; outside the transaction below (executescript commits first)
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
    return cost


class RequestStore:
    """Background-batched, exactly-once request records. ``put`` never blocks and never raises.

    Every record is either written, or counted in ``dropped`` (backlog full, put after close, close deadline passed)
    or ``failed`` (a row SQLite refused), each reported through ``on_drop`` / ``on_error`` and the log.
    """

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
        self.dropped = 0
        self.dropped_samples = 0
        self._drop_logged: dict[str, float] = {}
        self._key = load_secret(self.path, secret)
        self.schema_version = open_schema(self.path, self._key)
        self._reader_local = threading.local()
        self._thread = threading.Thread(target=self._run, name="tailguard-store", daemon=True)
        self._thread.start()

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

    def put_sample(self, t: float, running: int, waiting: int, server_queue: int, kv_used: int, kv_total: int) -> bool:
        with self._lock:
            if self._closed or self._pending >= self._max_backlog:
                self.dropped_samples += 1
                return False
            self._q.put(("sample", (t, running, waiting, server_queue, kv_used, kv_total), 0))
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
        return lost

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
        sequences withheld. Serve this, never ``tl.to_record()``, for records still in memory."""
        rec = tl.to_record()
        rec["user"] = self.pseudonym(rec["user"])
        rec["sampling"] = self._sampling(rec["sampling"], with_text=False)
        return rec

    def _sampling(self, sampling: dict[str, Any] | None, with_text: bool | None = None) -> dict[str, Any] | None:
        """Stop sequences are client text: redacted with text storage on, withheld (only their count) otherwise."""
        if not sampling or not sampling.get("stop"):
            return sampling
        out = dict(sampling)
        keep = self.store_text if with_text is None else with_text
        out["stop"] = [self._redact(s) for s in sampling["stop"]] if keep else None
        out["stop_count"] = len(sampling["stop"])
        return out

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
        if rec.get("gateway"):
            body["gateway"] = rec["gateway"]  # tenant, lane wait, replica, attempts, stalls
        body["sampling"] = self._sampling(rec["sampling"])
        action = json.dumps(tl.slo_action, separators=(",", ":")) if tl.slo_action else None
        return tuple(_safe(v) for v in (
            rec["request_id"], rec["received_at"], rec["endpoint"], rec["model"], self.pseudonym(rec["user"]),
            rec["business_type"], int(rec["stream"]), rec["status"], rec["outcome"] or "unknown",
            rec["finish_reason"], rec["error"], rec["prompt_tokens"], rec["output_tokens"], rec["e2e"], rec["ttft"],
            rec["tpot"], s["tokenize"], s["queue"], s["prefill"], s["decode"], s["stream"],
            json.dumps(body, ensure_ascii=False, separators=(",", ":")),
            prompt_text, output_text, token_ids, token_mac, logprobs, rec["lane"], rec["client"], rec["region"],
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

    def _done(self, n: int, nbytes: int) -> None:
        with self._idle:
            self._pending = max(0, self._pending - n)
            self._pending_bytes = max(0, self._pending_bytes - nbytes)
            if self._pending == 0:
                self._pending_bytes = 0
                self._idle.notify_all()

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("request store: the writer thread died; records from now on are counted as dropped")
            with self._lock:
                self._closed = True  # refuse (and count) new records rather than queue them for nobody

    def _loop(self) -> None:
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
                try:
                    # Gather what arrives within the flush interval into one transaction.
                    left = deadline - time.monotonic()
                    kind, item, cost = self._q.get(timeout=left) if left > 0 else self._q.get_nowait()
                except queue.Empty:
                    break
            if timelines or samples or alerts:
                try:
                    self._write(conn, timelines, samples, alerts)
                except Exception:  # noqa: BLE001 - the writer thread must outlive any bad batch
                    log.exception("request store: a batch of %d records lost", len(timelines) + len(alerts))
                    self.failed += len(timelines) + len(alerts)
                    if self._on_error:
                        self._on_error(len(timelines) + len(alerts))
                self._done(len(timelines) + len(alerts), nbytes)
            if time.monotonic() >= next_sweep and not stopping:
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
        "gateway": body.get("gateway"),
    }
    if any(row[k] is not None for k in ("prompt_text", "output_text", "prompt_token_ids", "logprobs")):
        rec["prompt_text"] = row["prompt_text"]
        rec["output_text"] = row["output_text"]
        rec["prompt_token_ids"] = json.loads(row["prompt_token_ids"]) if row["prompt_token_ids"] else None
        rec["prompt_token_hmac"] = row["prompt_token_hmac"]
        rec["logprobs"] = json.loads(row["logprobs"]) if row["logprobs"] else None
    return rec


def alert_row_to_record(row: sqlite3.Row) -> dict[str, Any]:
    """A stored SLO alert/action row as the dict the monitor emitted."""
    rec = {k: row[k] for k in _ALERT_COLUMNS}
    rec["dry_run"] = bool(rec["dry_run"])
    rec["figures"] = json.loads(rec["figures"])
    rec["details"] = json.loads(rec["details"])
    return rec
