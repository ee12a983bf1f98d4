"""Live sliding windows: a ring of per-interval t-digest sketches, merged on query.

Time is cut into slots of ``slot_s`` seconds (30 s by default). Each slot holds one :class:`_Cell` per *key*: the
combination (business type, lane, client class, region, context-length bucket) of a finished request. A cell keeps,
per latency metric, a small buffer of raw values that is folded into a ``fastdigest.TDigest`` every few thousand
values and when the slot closes, plus request counts by outcome, log-latency moments (for hotspots) and stage sums.

Recording a request is therefore a dict lookup and a few list appends (microseconds, measured in
``benchmarks/monitor_cost.py``). A query picks the slots of the window (5 minutes at peak, 15 otherwise: see
:class:`PeakDetector`) and the keys its :class:`~tailguard.slo.profiles.Selector` matches, and merges their digests.
Closed slots never change, so the merge of a key's closed slots is cached until the ring turns.

A fleet of gateways judges one view: each exports its slots (``export_slots``: counts and serialized digests per
key) and :meth:`SlidingWindows.merged` builds a read-only ring from every gateway's slots (t-digests merge), which the
evaluator queries like a local one (``tailguard.slo.monitor``, ``join_fleet``).

Window edges are slot-aligned: a window of ``n`` slots covers the current, partial slot and the ``n - 1`` before
it, i.e. between ``(n - 1) * slot_s`` and ``n * slot_s`` seconds of history.

Slots run on a steady clock (``steady_time``): the wall clock while it goes forward, and after a step back the last
reading advanced by ``time.monotonic()`` until the wall clock catches up. It never steps back: when the wall clock steps back (an NTP step, a VM resume), requests would otherwise go into a slot whose
index lies in the future, which no query covers until the wall clock catches up, and a tier would hold on no evidence
for as long as the step.
"""

from __future__ import annotations

import base64
import bisect
import heapq
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from fastdigest import TDigest

from tailguard.observe.timeline import Timeline
from tailguard.slo.profiles import Selector

__all__ = [
    "CORE_METRICS",
    "STAGES",
    "Key",
    "MetricStats",
    "PeakDetector",
    "RequestSample",
    "SlidingWindows",
    "WindowStats",
    "sample_from",
    "steady_for",
    "steady_time",
]

CORE_METRICS = ("e2e", "ttft", "itl", "queue_wait")
OPTIONAL_METRICS = ("tpot", "e2e_per_token", "tokenize", "prefill")
STAGES = ("tokenize", "queue", "prefill", "decode", "stream")
_STAGE_INDEX = {s: i for i, s in enumerate(STAGES)}

class _SteadyTime:
    """Unix seconds that never step back: the wall clock while it goes forward; after a step back, the last reading
    advanced by the monotonic clock until the wall clock catches up. Gateways of a fleet line their slots up by it,
    so it rejoins the wall clock (a clock that was wrong at start, then set by NTP, is followed, not kept)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the request path and the evaluation thread both read it
        self._last = time.time()
        self._mono = time.monotonic()

    def __call__(self) -> float:
        with self._lock:
            wall, mono = time.time(), time.monotonic()
            t = max(wall, self._last + (mono - self._mono))
            self._last, self._mono = t, mono
            return t


steady_time = _SteadyTime()


class NonDecreasing:
    """A clock of the caller's (a test's fake clock, an embedding's own) that never goes back: a backward step is
    absorbed, and time goes on from where it was, at the clock's pace."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._offset = 0.0
        self._last = -math.inf
        self._lock = threading.Lock()  # the request path and the evaluation thread both read it

    def __call__(self) -> float:
        with self._lock:
            t = self.clock() + self._offset
            if t < self._last:
                self._offset += self._last - t
                t = self._last
            self._last = t
            return t


def steady_for(clock: Callable[[], float]) -> Callable[[], float]:
    """The steady clock to judge by, next to a wall clock shown to people: :func:`steady_time` for ``time.time``;
    a caller's own clock made :class:`NonDecreasing` (a fake clock in tests drives both)."""
    return steady_time if clock is time.time else NonDecreasing(clock)


# Outcomes, as in tailguard.observe.timeline.Outcome.
SUCCESS, ERROR, ABORTED, REJECTED, INVALID = "success", "error", "aborted", "rejected", "invalid"
# Outcomes of requests the service took up (served, or refused at admission: a shed or a full queue). Only these keep
# their client and region: anything else (an invalid request, a 401 without a valid key) could make up any X-Client
# or X-Region and fill the key table.
_KEYED_OUTCOMES = frozenset((SUCCESS, ERROR, ABORTED, REJECTED))
# What a folded client or region reads.
OTHER = "other"


class Key(NamedTuple):
    """What a request is, for slicing: every view and every profile selects on these."""

    business_type: str
    lane: str
    client: str
    region: str
    ctx: int  # index of the context-length bucket (see SlidingWindows.ctx_edges)
    degraded: bool = False  # an action changed this answer (truncated): tiers may judge without these


@dataclass(slots=True)
class RequestSample:
    """The few figures of one finished request the monitor needs (seconds). Build one per request, or pass a
    Timeline or a store record to :func:`sample_from`."""

    e2e: float | None
    ttft: float | None = None
    queue_wait: float | None = None
    itl: Sequence[float] = ()
    tpot: float | None = None
    outcome: str = SUCCESS
    business_type: str = "default"
    lane: str = "default"
    client: str = "default"
    region: str = "default"
    input_tokens: int = 0
    degraded: bool = False
    request_id: str = ""
    stages: Mapping[str, float] | None = None
    synthetic: bool = False  # answered without the engine (a degradation template): counted, never timed
    output_tokens: int = 0
    streamed: bool = False  # a stream that sent its first token (the interruption rate's denominator)
    interrupted: bool = False  # a stream the server ended without [DONE] while the client was still there


def _s(v: Any, default: str = "default") -> str:
    return str(v) if v else default


def sample_from(obj: Any) -> RequestSample:
    """A :class:`RequestSample` from a Timeline (``tailguard.observe.timeline``), a record dict (``to_record()`` or a
    store row as a dict), or a RequestSample (returned as is). Unknown fields default; nothing here raises on a
    missing optional field."""
    if type(obj) is Timeline:  # the server's case: plain attribute reads, no getattr defaults
        s = obj.summary()
        o = obj.outcome
        return RequestSample(
            s.e2e, s.ttft, s.stages["queue"], s.itl, s.tpot, o.value if o is not None else SUCCESS,
            obj.business_type, obj.lane, obj.client, obj.region, obj.num_prompt_tokens, obj.degraded,
            obj.request_id, s.stages, obj.synthetic, obj.num_output_tokens,
            obj.stream and bool(obj.token_sent), obj.interrupted,
        )
    if isinstance(obj, RequestSample):
        return obj
    if isinstance(obj, Mapping):
        stages = obj.get("stages") or None
        outcome = obj.get("outcome") or SUCCESS
        itl = obj.get("itl")
        if itl is None:
            times = obj.get("token_sent") or obj.get("token_times") or ()
            itl = [b - a for a, b in zip(times, times[1:])]
        qw = obj.get("queue_wait")
        if qw is None and stages:
            qw = stages.get("queue")
        return RequestSample(
            e2e=obj.get("e2e"), ttft=obj.get("ttft"), queue_wait=qw, itl=itl, tpot=obj.get("tpot"),
            outcome=getattr(outcome, "value", outcome), business_type=_s(obj.get("business_type")),
            lane=_s(obj.get("lane")), client=_s(obj.get("client")), region=_s(obj.get("region")),
            input_tokens=int(obj.get("prompt_tokens") or obj.get("input_tokens") or 0),
            degraded=bool(obj.get("degraded")), request_id=str(obj.get("request_id") or ""), stages=stages,
            synthetic=bool(obj.get("synthetic")), output_tokens=int(obj.get("output_tokens") or 0),
            streamed=bool(obj.get("stream") and (obj.get("token_sent") or obj.get("streamed"))),
            interrupted=bool(obj.get("interrupted")),
        )
    # Anything else with summary() (duck-typed).
    s = obj.summary()
    outcome = getattr(obj, "outcome", None)
    return RequestSample(
        e2e=s.e2e, ttft=s.ttft, queue_wait=s.stages.get("queue"), itl=s.itl, tpot=s.tpot,
        outcome=getattr(outcome, "value", outcome) or SUCCESS,
        business_type=_s(getattr(obj, "business_type", None)), lane=_s(getattr(obj, "lane", None)),
        client=_s(getattr(obj, "client", None)), region=_s(getattr(obj, "region", None)),
        input_tokens=int(getattr(obj, "num_prompt_tokens", 0) or 0), degraded=bool(getattr(obj, "degraded", False)),
        request_id=str(getattr(obj, "request_id", "")), stages=s.stages,
        synthetic=bool(getattr(obj, "synthetic", False)),
        output_tokens=int(getattr(obj, "num_output_tokens", 0) or 0),
        streamed=bool(getattr(obj, "stream", False) and getattr(obj, "token_sent", None)),
        interrupted=bool(getattr(obj, "interrupted", False)),
    )


class _Cell:
    """One key in one slot."""

    __slots__ = ("bufs", "digests", "total", "served", "errors", "rejected", "aborted", "degraded",
                 "log_n", "log_sum", "log_sq", "stage_n", "stage_sum", "stage_sq", "streams", "interrupted")

    def __init__(self, n_metrics: int) -> None:
        self.bufs: list[list[float]] = [[] for _ in range(n_metrics)]
        self.digests: list[TDigest | None] = [None] * n_metrics
        self.total = self.served = self.errors = self.rejected = self.aborted = self.degraded = 0
        self.streams = self.interrupted = 0
        self.log_n = 0
        self.log_sum = self.log_sq = 0.0
        self.stage_n = 0
        self.stage_sum = [0.0] * len(STAGES)
        self.stage_sq = [0.0] * len(STAGES)


class _Slot:
    __slots__ = ("index", "cells", "top", "closed", "compacted", "aggs", "exported")

    def __init__(self, index: int) -> None:
        self.index = index
        self.exported: bytes | None = None  # a closed slot's serialized form (it never changes)
        self.cells: dict[Key, _Cell] = {}
        self.top: list[tuple] = []  # min-heap of the slowest requests: (e2e, seq, request_id, key, stages)
        self.closed = False  # no more writes (record only ever writes to the current slot)
        self.compacted = False  # buffers folded into digests (by a query, off the request path)
        self.aggs: dict[frozenset[Key], _Cell] = {}  # merged cells per key set: closed slots never change


def _key(parts: Sequence[Any]) -> Key:
    """A Key from its JSON list (``degraded`` defaults to False)."""
    return Key(str(parts[0]), str(parts[1]), str(parts[2]), str(parts[3]), int(parts[4]),
               bool(parts[5]) if len(parts) > 5 else False)


def _add_counts(dst: _Cell, c: _Cell) -> None:
    dst.total += c.total
    dst.served += c.served
    dst.errors += c.errors
    dst.rejected += c.rejected
    dst.aborted += c.aborted
    dst.degraded += c.degraded
    dst.streams += c.streams
    dst.interrupted += c.interrupted
    dst.log_n += c.log_n
    dst.log_sum += c.log_sum
    dst.log_sq += c.log_sq
    dst.stage_n += c.stage_n
    for i in range(len(STAGES)):
        dst.stage_sum[i] += c.stage_sum[i]
        dst.stage_sq[i] += c.stage_sq[i]


def _merge_into(parts: Iterable[TDigest | None]) -> TDigest | None:
    merged: TDigest | None = None
    for d in parts:
        if d is None:
            continue
        if merged is None:
            merged = d.copy()
        else:
            merged.merge_inplace(d)
    return merged


@dataclass
class MetricStats:
    n: int
    digest: TDigest | None

    def quantile(self, q: float) -> float | None:
        return None if self.digest is None or self.n == 0 else float(self.digest.quantile(q))

    def percentiles(self, qs: Iterable[float] = (0.5, 0.95, 0.99)) -> dict[str, float | None]:
        return {f"p{q * 100:g}": self.quantile(q) for q in qs}


@dataclass
class WindowStats:
    """What one query over a window saw. Rates are over the window; latencies come from the merged sketches.

    Counts: ``total`` every finished request; ``served`` those that reached the engine (success, error, aborted);
    ``rejected`` refused at admission (429/503, shed); ``invalid`` requests are counted in ``total`` only.
    ``error_rate`` = errors / served; ``shed_rate`` = rejected / (served + rejected);
    ``degradation_rate`` = degraded answers / served; ``interruption_rate`` = streams the server ended without
    ``[DONE]`` (the client still there) / streams that sent their first token.
    """

    window_s: float
    start: float
    end: float
    total: int = 0
    served: int = 0
    errors: int = 0
    rejected: int = 0
    aborted: int = 0
    degraded: int = 0
    streams: int = 0
    interrupted: int = 0
    metrics: dict[str, MetricStats] = field(default_factory=dict)
    log_n: int = 0
    log_sum: float = 0.0
    log_sq: float = 0.0
    stage_n: int = 0
    stage_sum: list[float] = field(default_factory=lambda: [0.0] * len(STAGES))
    stage_sq: list[float] = field(default_factory=lambda: [0.0] * len(STAGES))

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.served if self.served else None

    @property
    def shed_rate(self) -> float | None:
        d = self.served + self.rejected
        return self.rejected / d if d else None

    @property
    def degradation_rate(self) -> float | None:
        return self.degraded / self.served if self.served else None

    @property
    def interruption_rate(self) -> float | None:
        return self.interrupted / self.streams if self.streams else None

    def rate(self, name: str) -> float | None:
        return {"error_rate": self.error_rate, "shed_rate": self.shed_rate,
                "degradation_rate": self.degradation_rate, "interruption_rate": self.interruption_rate}[name]

    def rate_samples(self, name: str) -> int:
        """What a rate is a share of: streams for the interruption rate, served requests for the others."""
        return self.streams if name == "interruption_rate" else self.served

    def n(self, metric: str) -> int:
        m = self.metrics.get(metric)
        return m.n if m else 0

    def quantile(self, metric: str, q: float) -> float | None:
        m = self.metrics.get(metric)
        return m.quantile(q) if m else None

    @property
    def log_mean(self) -> float | None:
        return self.log_sum / self.log_n if self.log_n else None

    @property
    def log_std(self) -> float | None:
        if self.log_n < 2:
            return None
        mean = self.log_sum / self.log_n
        return math.sqrt(max(0.0, self.log_sq / self.log_n - mean * mean))

    def stage_means(self) -> dict[str, float]:
        if not self.stage_n:
            return {}
        return {s: self.stage_sum[i] / self.stage_n for i, s in enumerate(STAGES)}

    def stage_stds(self) -> dict[str, float]:
        n = self.stage_n
        if n < 2:
            return {}
        out = {}
        for i, s in enumerate(STAGES):
            m = self.stage_sum[i] / n
            out[s] = math.sqrt(max(0.0, self.stage_sq[i] / n - m * m))
        return out

    def summary(self, metrics: Iterable[str] = CORE_METRICS) -> dict[str, Any]:
        """JSON-ready: counts, rates, P50/P95/P99 per metric."""
        out: dict[str, Any] = {
            "window_s": self.window_s, "start": self.start, "end": self.end, "total": self.total,
            "served": self.served, "errors": self.errors, "rejected": self.rejected, "aborted": self.aborted,
            "degraded": self.degraded, "error_rate": self.error_rate, "shed_rate": self.shed_rate,
            "degradation_rate": self.degradation_rate, "streams": self.streams, "interrupted": self.interrupted,
            "interruption_rate": self.interruption_rate,
        }
        for m in metrics:
            st = self.metrics.get(m)
            out[m] = {"n": st.n if st else 0, **(st.percentiles() if st else {"p50": None, "p95": None, "p99": None})}
        return out


def _parse_hours(spec: str) -> tuple[int, int]:
    """``"09:00-12:30"`` -> (540, 750) minutes of the day; an end before the start wraps past midnight."""
    try:
        a, b = spec.split("-")

        def minutes(x: str) -> int:
            h, _, m = x.strip().partition(":")
            v = int(h) * 60 + (int(m) if m else 0)
            if not 0 <= v <= 24 * 60:
                raise ValueError
            return v

        return minutes(a), minutes(b)
    except ValueError:
        raise ValueError(f"peak hours {spec!r}: write HH:MM-HH:MM, e.g. 09:00-12:00") from None


class PeakDetector:
    """Is it peak time? (The window is 5 minutes at peak and 15 minutes otherwise.)

    Modes: ``configured`` (hour ranges in a time zone), ``detected`` (from traffic), ``always``, ``never``.
    Detection compares the request rate of the last ``recent_s`` seconds with a slow moving average of the rate
    (exponential, half-life ``baseline_half_life_s``, updated each time the ring turns): peak starts when the
    recent rate reaches ``enter_ratio`` x the baseline (and at least ``min_rps``) and ends when it falls below
    ``exit_ratio`` x the baseline. Until ``warmup_s`` of history exist there is no baseline, so it is off-peak
    (the longer, 15-minute window: the conservative choice for a P99).
    """

    def __init__(
        self,
        mode: str = "detected",
        hours: Sequence[str] = (),
        timezone: str = "UTC",
        enter_ratio: float = 1.5,
        exit_ratio: float = 1.2,
        min_rps: float = 0.5,
        recent_s: float = 300.0,
        baseline_half_life_s: float = 6 * 3600.0,
        warmup_s: float = 1800.0,
    ) -> None:
        if mode not in ("configured", "detected", "always", "never"):
            raise ValueError(f"peak mode {mode!r}: one of configured, detected, always, never")
        if mode == "configured" and not hours:
            raise ValueError("peak mode 'configured' needs hours, e.g. ['09:00-12:00', '19:00-22:00']")
        self.mode = mode
        self.ranges = [_parse_hours(h) for h in hours]
        from zoneinfo import ZoneInfo

        self.tz = ZoneInfo(timezone)
        self.enter_ratio, self.exit_ratio, self.min_rps = enter_ratio, exit_ratio, min_rps
        self.recent_s, self.half_life, self.warmup_s = recent_s, baseline_half_life_s, warmup_s
        self.baseline_rps: float | None = None
        self.recent_rps: float = 0.0
        self._history_s = 0.0
        self._peak = False

    def in_configured_hours(self, now: float) -> bool:
        dt = datetime.fromtimestamp(now, self.tz)
        m = dt.hour * 60 + dt.minute
        return any((a <= m < b) if a <= b else (m >= a or m < b) for a, b in self.ranges)

    def observe_slot(self, requests: int, slot_s: float) -> None:
        """Fold one closed slot's request count into the baseline."""
        rps = requests / slot_s
        self._history_s += slot_s
        if self.baseline_rps is None:
            self.baseline_rps = rps
        else:
            alpha = 1.0 - 0.5 ** (slot_s / self.half_life)
            self.baseline_rps += alpha * (rps - self.baseline_rps)

    def update(self, now: float, recent_rps: float) -> bool:
        self.recent_rps = recent_rps
        if self.mode == "always":
            self._peak = True
        elif self.mode == "never":
            self._peak = False
        elif self.mode == "configured":
            self._peak = self.in_configured_hours(now)
        elif self.baseline_rps is None or self._history_s < self.warmup_s:
            self._peak = False
        else:
            base = max(self.baseline_rps, 1e-9)
            if self._peak:
                self._peak = recent_rps >= self.exit_ratio * base and recent_rps >= self.min_rps
            else:
                self._peak = recent_rps >= self.enter_ratio * base and recent_rps >= self.min_rps
        return self._peak

    @property
    def peak(self) -> bool:
        return self._peak

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "peak": self._peak, "recent_rps": self.recent_rps,
                "baseline_rps": self.baseline_rps, "hours": [f"{a // 60:02d}:{a % 60:02d}-{b // 60:02d}:{b % 60:02d}"
                                                            for a, b in self.ranges]}


class SlidingWindows:
    """The ring of slots. ``record`` is the hot path; ``query`` merges.

    ``metrics``: latency metrics kept (the core four plus any of ``tpot``, ``e2e_per_token``, ``tokenize``,
    ``prefill``).
    ``ctx_edges``: prompt-length bucket edges in tokens (a request with ``t`` tokens falls in the first bucket whose
    upper edge is >= t); the defaults put 8K (the long-context watch) and 64K (the decay objective) on edges.
    ``max_keys``: cardinality guard. Past it, a new key's client and region (free-form headers) are folded into
    ``"other"``; its business type and lane (bounded sets, which scopes and objectives select on) are kept. Requests
    the service never took up (invalid, unauthorized) never hold a client or region of their own.
    ``max_regions``: the regions that keep their name (the first seen, among the keys the ring holds); a new key of
    any further region is counted under region ``"other"``. The regions view queries each region every evaluation,
    so this bounds its cost (as the metrics' region label is bounded).
    """

    def __init__(
        self,
        slot_s: float = 30.0,
        max_window_s: float = 900.0,
        metrics: Sequence[str] = CORE_METRICS,
        ctx_edges: Sequence[int] = (8192, 65536),
        max_centroids: int = 200,  # errors < 0.1% at P50/P95/P99 here, and a merge 6x cheaper than 1000
        buffer_limit: int = 4096,
        top_per_slot: int = 32,
        max_keys: int = 512,
        max_pending: int = 100_000,  # ~17 min at 100 req/s with no evaluation: beyond, drop and count
        clock: Callable[[], float] = steady_time,  # must not step back (see steady_time)
        on_slot_closed: Callable[[int, float], None] | None = None,
        max_regions: int = 32,
    ) -> None:
        if slot_s <= 0 or max_window_s < slot_s:
            raise ValueError("need 0 < slot_s <= max_window_s")
        self.slot_s = float(slot_s)
        self.max_slots = math.ceil(max_window_s / slot_s)
        self.metrics = tuple(metrics)
        unknown = set(self.metrics) - set(CORE_METRICS) - set(OPTIONAL_METRICS)
        if unknown:
            raise ValueError(f"cannot keep windows for {sorted(unknown)}")
        self._mi = {m: i for i, m in enumerate(self.metrics)}
        self.ctx_edges = tuple(sorted(set(int(e) for e in ctx_edges)))
        self.max_centroids = max_centroids
        self.buffer_limit = buffer_limit
        self.top_per_slot = top_per_slot
        self.max_keys = max_keys
        self.max_regions = max_regions
        self.clock = clock
        self.on_slot_closed = on_slot_closed
        self._ring: deque[_Slot] = deque()
        self._cur: _Slot | None = None
        self._keys: set[Key] = set()
        self._regions: set[str] = set()  # the regions of _keys
        self._seq = 0
        self._lock = threading.Lock()
        self._agg_lock = threading.Lock()  # query side only: compaction and per-slot aggregates
        self._queue: deque[tuple[float, Any]] = deque()  # recorded, not yet applied (see record)
        self._closed_turn: tuple[int, ...] | None = None
        self._closed_merged: dict[tuple[frozenset[Key], int], TDigest | None] = {}
        self._closed_counts: dict[frozenset[Key], _Cell] = {}  # counts of the closed slots, per key set
        self.max_pending = max_pending
        self.dropped_samples = 0
        self.bad_samples = 0
        # Which optional metrics to compute on the record path.
        self._i_e2e = self._mi.get("e2e")
        self._i_ttft = self._mi.get("ttft")
        self._i_itl = self._mi.get("itl")
        self._i_queue = self._mi.get("queue_wait")
        self._i_tpot = self._mi.get("tpot")
        self._i_e2e_tok = self._mi.get("e2e_per_token")
        self._i_tok = self._mi.get("tokenize")
        self._i_pre = self._mi.get("prefill")
        self.dropped_keys = 0

    # --- keys ------------------------------------------------------------------------------------------------------
    def ctx_bucket(self, tokens: int) -> int:
        return bisect.bisect_left(self.ctx_edges, tokens)

    def ctx_range(self, bucket: int) -> tuple[int, int | None]:
        """(lowest, highest) prompt tokens of a bucket; None: unbounded."""
        lo = 0 if bucket == 0 else self.ctx_edges[bucket - 1] + 1
        hi = self.ctx_edges[bucket] if bucket < len(self.ctx_edges) else None
        return lo, hi

    def key_matches(self, key: Key, sel: Selector, peak: bool = False) -> bool:
        if sel.business_types and key.business_type not in sel.business_types:
            return False
        if sel.lanes and key.lane not in sel.lanes:
            return False
        if key.lane in sel.not_lanes:
            return False
        if sel.clients and key.client not in sel.clients:
            return False
        if sel.regions and key.region not in sel.regions:
            return False
        if sel.min_input_tokens is not None or sel.max_input_tokens is not None:
            lo, hi = self.ctx_range(key.ctx)
            if sel.min_input_tokens is not None and lo < sel.min_input_tokens:
                return False
            if sel.max_input_tokens is not None and (hi is None or hi > sel.max_input_tokens):
                return False
        return not (sel.peak_only and not peak)

    def known_keys(self) -> set[Key]:
        return set(self._keys)

    def _folded(self, key: Key) -> Key:
        """Where a new key goes once the table is full: client and region become "other", business type and lane
        stay, so lane and business-type scopes keep seeing their traffic. Lanes and business types are bounded sets
        in the server; should they not be, past twice ``max_keys`` everything folds."""
        folded = key._replace(client=OTHER, region=OTHER)
        if folded not in self._keys and len(self._keys) >= 2 * self.max_keys:
            folded = Key(OTHER, OTHER, OTHER, OTHER, key.ctx, key.degraded)
        return folded

    # --- hot path ----------------------------------------------------------------------------------------------------
    def _rotate(self, idx: int) -> _Slot:
        """Close the current slot and open slot ``idx`` (called with the lock held)."""
        cur = self._cur
        if cur is not None:
            self._close(cur)
            gap = idx - cur.index - 1
            if gap > 0 and self.on_slot_closed is not None:
                self.on_slot_closed(0, gap * self.slot_s)  # idle slots count as zero traffic for the peak baseline
        slot = _Slot(idx)
        self._ring.append(slot)
        self._cur = slot
        dropped = False
        while self._ring and self._ring[0].index <= idx - self.max_slots:
            self._ring.popleft()
            dropped = True
        if dropped:  # forget keys no slot holds any more
            self._keys = set().union(*(s.cells.keys() for s in self._ring))
            self._regions = {k.region for k in self._keys}
        return slot

    def _close(self, slot: _Slot) -> None:
        # Runs in drain() or advance(), i.e. in the evaluation thread: the request path only queues.
        slot.closed = True
        with self._agg_lock:
            self._compact(slot)
        if self.on_slot_closed is not None:
            self.on_slot_closed(sum(c.total for c in slot.cells.values()), self.slot_s)

    def _compact(self, slot: _Slot) -> None:
        """Fold a closed slot's buffers into its digests (once; called with ``_agg_lock`` held, not ``_lock``)."""
        if slot.compacted:
            return
        mc = self.max_centroids
        for cell in slot.cells.values():
            for i, buf in enumerate(cell.bufs):
                if buf:
                    d = cell.digests[i]
                    if d is None:
                        cell.digests[i] = TDigest.from_values(buf, max_centroids=mc)
                    else:
                        d.batch_update(buf)
                    cell.bufs[i] = []
        slot.compacted = True

    def _slot_agg(self, slot: _Slot, keys: frozenset[Key], mis: Iterable[int]) -> _Cell:
        """The closed slot's cells of ``keys`` merged (counts and the digests of metrics ``mis``), cached."""
        agg = slot.aggs.get(keys)
        if agg is None:
            self._compact(slot)
            agg = _Cell(len(self.metrics))
            agg.digests = [False] * len(self.metrics)  # type: ignore[list-item] - False: not merged yet
            for k in keys:
                c = slot.cells.get(k)
                if c is not None:
                    _add_counts(agg, c)
            slot.aggs[keys] = agg
        for mi in mis:
            if agg.digests[mi] is False:
                agg.digests[mi] = _merge_into(slot.cells[k].digests[mi] for k in keys if k in slot.cells)
        return agg

    def _flush(self, cell: _Cell, i: int) -> None:
        buf = cell.bufs[i]
        d = cell.digests[i]
        if d is None:
            cell.digests[i] = TDigest.from_values(buf, max_centroids=self.max_centroids)
        else:
            d.batch_update(buf)
        cell.bufs[i] = []

    def record(self, s: Any, now: float | None = None) -> None:
        """Add one finished request (a RequestSample, a Timeline or a record dict): the request path's only cost.

        It is queued, not applied: one deque append. Queries, ``advance`` and ``drain`` (the evaluation thread)
        apply the queue first, so every figure they report includes every request recorded before them."""
        if len(self._queue) >= self.max_pending:
            self.dropped_samples += 1  # nobody has drained for a long time: drop rather than grow without bound
            return
        self._queue.append((self.clock() if now is None else now, s))

    def drain(self) -> int:
        """Apply the queued requests to their slots; returns how many."""
        q = self._queue
        n = 0
        with self._lock:
            while True:
                try:
                    now, s = q.popleft()  # deque: safe against concurrent appends
                except IndexError:
                    return n
                n += 1
                try:
                    self._apply(s if type(s) is RequestSample else sample_from(s), now)
                except Exception:  # noqa: BLE001 - one malformed record must not stop the rest
                    self.bad_samples += 1

    def _apply(self, s: RequestSample, now: float) -> None:
        """Add one finished request to its slot (``_lock`` held)."""
        idx = int(now // self.slot_s)
        tokens = s.input_tokens
        edges = self.ctx_edges
        ctx = 0 if not edges or tokens <= edges[0] else bisect.bisect_left(edges, tokens)
        outcome = s.outcome
        if outcome in _KEYED_OUTCOMES:
            key = Key(s.business_type, s.lane, s.client, s.region, ctx, s.degraded)
        else:  # never taken up: counted under its business type and lane, without the client or region it claims
            key = Key(s.business_type, s.lane, OTHER, OTHER, ctx, s.degraded)
        slot = self._cur
        if slot is None or idx > slot.index:
            slot = self._rotate(idx)
        cell = slot.cells.get(key)
        if cell is None:
            if key not in self._keys:
                folded = key
                if folded.region not in self._regions and folded.region != "default" \
                        and len(self._regions) >= self.max_regions:
                    folded = folded._replace(region=OTHER)
                if folded not in self._keys and len(self._keys) >= self.max_keys:
                    folded = self._folded(folded)
                if folded != key:
                    self.dropped_keys += 1
                    key = folded
                self._keys.add(key)
                self._regions.add(key.region)
            cell = slot.cells.get(key)
            if cell is None:
                cell = slot.cells[key] = _Cell(len(self.metrics))
        cell.total += 1
        if s.streamed:
            cell.streams += 1
            if s.interrupted:
                cell.interrupted += 1
        if outcome == SUCCESS:
            cell.served += 1
        elif outcome == ERROR:
            cell.served += 1
            cell.errors += 1
        elif outcome == ABORTED:
            cell.served += 1
            cell.aborted += 1
        elif outcome == REJECTED:
            cell.rejected += 1
            return
        else:  # invalid or unknown: counted, not timed (as tailguard.observe.metrics does)
            return
        if s.degraded:
            cell.degraded += 1
        if s.synthetic:
            return  # a template answer's latency says nothing about the engine
        bufs = cell.bufs
        limit = self.buffer_limit
        i = self._i_ttft
        if i is not None and s.ttft is not None:
            bufs[i].append(s.ttft)
            if len(bufs[i]) >= limit:
                self._flush(cell, i)
        i = self._i_queue
        if i is not None and s.queue_wait is not None:
            bufs[i].append(s.queue_wait)
            if len(bufs[i]) >= limit:
                self._flush(cell, i)
        i = self._i_itl
        if i is not None and s.itl:
            bufs[i].extend(s.itl)
            if len(bufs[i]) >= limit:
                self._flush(cell, i)
        stages = s.stages
        if stages:
            cell.stage_n += 1
            ss, sq = cell.stage_sum, cell.stage_sq
            for j, name in enumerate(STAGES):
                v = stages.get(name)
                if v:
                    ss[j] += v
                    sq[j] += v * v
            i = self._i_tok
            if i is not None and "tokenize" in stages:
                bufs[i].append(stages["tokenize"])
            i = self._i_pre
            if i is not None and "prefill" in stages:
                bufs[i].append(stages["prefill"])
        if outcome != SUCCESS:
            return  # E2E and TPOT describe complete answers only
        e2e = s.e2e
        if e2e is None:
            return
        i = self._i_e2e
        if i is not None:
            bufs[i].append(e2e)
            if len(bufs[i]) >= limit:
                self._flush(cell, i)
        i = self._i_tpot
        if i is not None and s.tpot is not None:
            bufs[i].append(s.tpot)
        i = self._i_e2e_tok
        if i is not None and s.output_tokens > 0:
            bufs[i].append(e2e / s.output_tokens)
        if e2e > 0:
            lg = math.log(e2e)
            cell.log_n += 1
            cell.log_sum += lg
            cell.log_sq += lg * lg
        top = slot.top
        if len(top) < self.top_per_slot:
            self._seq += 1
            heapq.heappush(top, (e2e, self._seq, s.request_id, key, dict(stages) if stages else None, now))
        elif e2e > top[0][0]:
            self._seq += 1
            heapq.heapreplace(top, (e2e, self._seq, s.request_id, key, dict(stages) if stages else None, now))

    # --- queries -------------------------------------------------------------------------------------------------
    def advance(self, now: float | None = None) -> None:
        """Turn the ring up to ``now`` even without traffic (evaluate calls it)."""
        if now is None:
            now = self.clock()
        self.drain()
        idx = int(now // self.slot_s)
        with self._lock:
            if self._cur is None or idx > self._cur.index:
                self._rotate(idx)

    def _window_slots(self, n_slots: int, now: float) -> tuple[list[_Slot], _Slot | None, int]:
        idx = int(now // self.slot_s)
        lo = idx - n_slots
        closed = [s for s in self._ring if lo < s.index <= idx and s.closed]
        cur = self._cur if self._cur is not None and lo < self._cur.index <= idx and not self._cur.closed else None
        return closed, cur, idx

    def _current_snapshot(self, cur: _Slot, keys: list[Key], mis: list[int]) -> _Cell:
        """The current slot's cells of ``keys``, copied (called with ``_lock`` held: copies only, no merging)."""
        snap = _Cell(len(self.metrics))
        parts: list[list[TDigest]] = [[] for _ in self.metrics]
        for k in keys:
            c = cur.cells.get(k)
            if c is None:
                continue
            _add_counts(snap, c)
            for mi in mis:
                if c.digests[mi] is not None:
                    parts[mi].append(c.digests[mi].copy())
                if c.bufs[mi]:
                    snap.bufs[mi].extend(c.bufs[mi])
        snap.digests = parts  # type: ignore[assignment] - lists of digests, merged outside the lock
        return snap

    def query(
        self,
        selector: Selector | None = None,
        window_s: float = 300.0,
        now: float | None = None,
        metrics: Iterable[str] | None = None,
        peak: bool = False,
        keys: Iterable[Key] | None = None,
        exclude_degraded: bool = False,
    ) -> WindowStats:
        """Merge the window's slots for the keys ``selector`` matches (or the given ``keys``).

        The request path's lock is held only to pick the slots and copy the current slot's cells; merging happens
        outside it, on per-slot aggregates that closed slots keep (a closed slot never changes), so a query costs
        one merge per slot and metric plus the newest closed slot's own merge. ``exclude_degraded``: leave out the
        answers an action changed (the tiers judge some metrics without them)."""
        if now is None:
            now = self.clock()
        n_slots = max(1, min(self.max_slots, math.ceil(window_s / self.slot_s - 1e-9)))
        sel = selector or Selector()
        wanted = [m for m in (metrics or self.metrics) if m in self._mi]
        mis = [self._mi[m] for m in wanted]
        self.drain()
        with self._lock:
            closed, cur, idx = self._window_slots(n_slots, now)
            if keys is None:
                keys = [k for k in self._keys if self.key_matches(k, sel, peak)
                        and not (exclude_degraded and k.degraded)]
            keys = list(keys)
            snap = self._current_snapshot(cur, keys, mis) if cur is not None else None
        keyset = frozenset(keys)
        stats = WindowStats(window_s=n_slots * self.slot_s, start=(idx - n_slots + 1) * self.slot_s, end=now)
        total = _Cell(len(self.metrics))
        with self._agg_lock:
            aggs = [self._slot_agg(slot, keyset, mis) for slot in closed]
        # Which closed slots the window holds: slots only close at the top and leave at the bottom of the ring.
        turn = (idx, n_slots, len(closed), closed[0].index if closed else -1, closed[-1].index if closed else -1)
        if self._closed_turn != turn:  # the ring turned: merges of closed slots are stale
            self._closed_turn, self._closed_merged, self._closed_counts = turn, {}, {}
        closed_total = self._closed_counts.get(keyset)
        if closed_total is None:  # once per key set and turn: a scope per region would add every slot each time
            closed_total = self._closed_counts[keyset] = _Cell(len(self.metrics))
            for a in aggs:
                _add_counts(closed_total, a)
        _add_counts(total, closed_total)
        if snap is not None:
            _add_counts(total, snap)
        for name in ("total", "served", "errors", "rejected", "aborted", "degraded", "streams", "interrupted", "log_n",
                     "log_sum", "log_sq", "stage_n", "stage_sum", "stage_sq"):
            setattr(stats, name, getattr(total, name))
        mc = self.max_centroids
        for m, mi in zip(wanted, mis, strict=True):
            ck = (keyset, mi)
            if ck not in self._closed_merged:
                self._closed_merged[ck] = _merge_into(a.digests[mi] for a in aggs)
            closed_d = self._closed_merged[ck]
            parts = [closed_d]
            if snap is not None:
                parts += snap.digests[mi]
                if snap.bufs[mi]:
                    parts.append(TDigest.from_values(snap.bufs[mi], max_centroids=mc))
            merged = _merge_into(parts)
            stats.metrics[m] = MetricStats(n=0 if merged is None else int(merged.n_values), digest=merged)
        return stats

    def slowest(
        self, window_s: float, now: float | None = None, selector: Selector | None = None, peak: bool = False
    ) -> list[dict[str, Any]]:
        """The slowest requests kept in the window (the top ``top_per_slot`` of each slot), slowest first."""
        if now is None:
            now = self.clock()
        n_slots = max(1, min(self.max_slots, math.ceil(window_s / self.slot_s - 1e-9)))
        sel = selector or Selector()
        self.drain()
        with self._lock:
            closed, cur, _ = self._window_slots(n_slots, now)
            items = [e for s in ([*closed, cur] if cur is not None else closed) for e in s.top]
        out = [
            {"request_id": rid, "e2e": e2e, "key": key._asdict(), "stages": stages, "at": at}
            for e2e, _seq, rid, key, stages, at in items
            if self.key_matches(key, sel, peak)
        ]
        out.sort(key=lambda r: -r["e2e"])
        return out

    # --- a fleet's view ----------------------------------------------------------------------------------------------
    def export_slots(self, now: float | None = None) -> dict[int, bytes]:
        """Every slot in the ring, serialized (JSON; digests as fastdigest's bytes, base64), by slot index: what
        another gateway needs to merge this one's windows into a fleet view. Closed slots are serialized once."""
        self.advance(now)
        with self._lock:
            slots = list(self._ring)
            cur = self._cur
            open_cells: dict[Key, _Cell] = {}
            open_top: list[tuple] = []
            if cur is not None and not cur.closed:
                mis = list(range(len(self.metrics)))
                for k in cur.cells:
                    snap = self._current_snapshot(cur, [k], mis)
                    open_cells[k] = snap
                open_top = list(cur.top)
        out: dict[int, bytes] = {}
        mc = self.max_centroids
        for slot in slots:
            if slot is cur and not slot.closed:
                cells = []
                for k, snap in open_cells.items():
                    parts = snap.digests  # lists of digest copies (see _current_snapshot), plus the raw buffers
                    digests: list[TDigest | None] = []
                    for mi in range(len(self.metrics)):
                        ps = list(parts[mi])  # type: ignore[arg-type]
                        if snap.bufs[mi]:
                            ps.append(TDigest.from_values(snap.bufs[mi], max_centroids=mc))
                        digests.append(_merge_into(ps))
                    cells.append(self._encode_cell(k, snap, digests))
                out[slot.index] = self._encode_slot(slot.index, cells, open_top, closed=False)
                continue
            if slot.exported is None:
                with self._agg_lock:
                    self._compact(slot)
                cells = [self._encode_cell(k, c, c.digests) for k, c in slot.cells.items()]
                slot.exported = self._encode_slot(slot.index, cells, slot.top, closed=True)
            out[slot.index] = slot.exported
        return out

    def _encode_cell(self, key: Key, c: _Cell, digests: Sequence[TDigest | None]) -> dict[str, Any]:
        return {
            "key": list(key),
            "counts": [c.total, c.served, c.errors, c.rejected, c.aborted, c.degraded, c.log_n, c.log_sum, c.log_sq,
                       c.stage_n, c.streams, c.interrupted],
            "stage_sum": c.stage_sum, "stage_sq": c.stage_sq,
            "digests": {m: base64.b64encode(d.to_bytes()).decode() for m, d in zip(self.metrics, digests, strict=True)
                        if d is not None},
        }

    @staticmethod
    def _encode_slot(index: int, cells: list[dict[str, Any]], top: list[tuple], closed: bool) -> bytes:
        return json.dumps({"index": index, "closed": closed, "cells": cells,
                           "top": [[e2e, rid, list(key), stages, at] for e2e, _seq, rid, key, stages, at in top]},
                          separators=(",", ":")).encode()

    def decode_slot(self, raw: bytes) -> _Slot:
        """One slot as ``export_slots`` wrote it, decoded (``closed``: it will not change again, so it may be kept).
        Metrics this ring does not keep are skipped."""
        data = json.loads(raw)
        slot = _Slot(int(data["index"]))
        slot.closed = bool(data["closed"])
        slot.compacted = True
        for cd in data["cells"]:
            cell = slot.cells[_key(cd["key"])] = _Cell(len(self.metrics))
            counts = cd["counts"]
            (cell.total, cell.served, cell.errors, cell.rejected, cell.aborted, cell.degraded, cell.log_n,
             cell.log_sum, cell.log_sq, cell.stage_n) = counts[:10]
            if len(counts) >= 12:  # a gateway of an earlier release sends no stream counts
                cell.streams, cell.interrupted = counts[10], counts[11]
            cell.stage_sum, cell.stage_sq = list(cd["stage_sum"]), list(cd["stage_sq"])
            for m, b64 in cd["digests"].items():
                mi = self._mi.get(m)
                if mi is not None:
                    cell.digests[mi] = TDigest.from_bytes(base64.b64decode(b64))
        slot.top = [(e2e, 0, rid, _key(key), stages, at) for e2e, rid, key, stages, at in data["top"]]
        return slot

    def merge_slots(self, parts: Iterable[_Slot]) -> _Slot:
        """One slot from the same slot of several gateways: counts added, digests merged, the slowest requests
        pooled. The parts are left unchanged (decoded closed slots are kept and merged again)."""
        slot: _Slot | None = None
        seq = 0
        for part in parts:
            if slot is None:
                slot = _Slot(part.index)
                slot.closed = slot.compacted = True
            for key, c in part.cells.items():
                cell = slot.cells.get(key)
                if cell is None:
                    cell = slot.cells[key] = _Cell(len(self.metrics))
                _add_counts(cell, c)
                for mi, d in enumerate(c.digests):
                    if d is None:
                        continue
                    mine = cell.digests[mi]
                    if mine is None:
                        cell.digests[mi] = d.copy()
                    else:
                        mine.merge_inplace(d)
            for e2e, _seq, rid, key, stages, at in part.top:
                seq += 1
                item = (e2e, seq, rid, key, stages, at)
                if len(slot.top) < self.top_per_slot:
                    heapq.heappush(slot.top, item)
                elif e2e > slot.top[0][0]:
                    heapq.heapreplace(slot.top, item)
        if slot is None:
            raise ValueError("no slot to merge")
        return slot

    def ring(self, slots: Iterable[_Slot]) -> SlidingWindows:
        """A read-only ring of these (merged, closed) slots, one per index, to query like this one."""
        fleet = SlidingWindows(self.slot_s, self.max_slots * self.slot_s, self.metrics, self.ctx_edges,
                               self.max_centroids, self.buffer_limit, self.top_per_slot, self.max_keys,
                               clock=self.clock, max_regions=self.max_regions)
        fleet._ring = deque(sorted(slots, key=lambda sl: sl.index))
        fleet._keys = set().union(*(sl.cells.keys() for sl in fleet._ring)) if fleet._ring else set()
        fleet._regions = {k.region for k in fleet._keys}
        return fleet

    def merged(self, parts: Iterable[_Slot | bytes]) -> SlidingWindows:
        """The fleet's windows from the given slots (decoded, or as exported) of any number of gateways: the slots
        of each index merged (``merge_slots``), in a read-only ring (``ring``). The parts are left unchanged."""
        by_index: dict[int, list[_Slot]] = {}
        for part in parts:
            sl = self.decode_slot(part) if isinstance(part, bytes) else part
            by_index.setdefault(sl.index, []).append(sl)
        return self.ring(self.merge_slots(group) for group in by_index.values())

    def requests_in(self, seconds: float, now: float | None = None) -> int:
        """Finished requests in the last ``seconds`` (slot-aligned), for rate estimates."""
        if now is None:
            now = self.clock()
        n_slots = max(1, min(self.max_slots, math.ceil(seconds / self.slot_s - 1e-9)))
        self.drain()
        with self._lock:
            closed, cur, _ = self._window_slots(n_slots, now)
            return sum(c.total for s in ([*closed, cur] if cur is not None else closed) for c in s.cells.values())
