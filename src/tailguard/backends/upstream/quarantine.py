"""Query-of-death guard: one request must not take the replicas down one after another.

A request under which a replica failed (a 5xx answer other than 503, the connection cut after the request went out,
an error event, a stream ended without ``[DONE]``) may have caused the failure: it is retried on another replica at
most once (``RoutingConfig.failure_retries``), where a replica that merely could not take it (no connection, 429,
503) leaves the other retries as they were. Each such failure is remembered by the request's fingerprint (a hash of
its canonical body, ``fingerprint``); once replicas have failed under the same request ``quarantine_after`` times
(two by default: two replicas in this request, or across resubmissions of it within ``quarantine_s``, where
one replica failing twice counts too), the gateway refuses that request
itself for ``quarantine_s`` (``UpstreamBackend`` answers 422) instead of sending it to another replica. A request of
that fingerprint that completes clears what was held against it (the earlier failure was not its fault).

The fingerprint is computed only while something is held (a failure, a quarantine): otherwise a request costs
nothing here. The table is bounded (``MAX_ENTRIES``, oldest dropped first), so a flood of distinct failing requests
cannot grow it without end.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_ENTRIES = 4096

# Fields that do not change what the engine computes: varying them must not make a different request. The model is
# the gateway's to set (every replica serves the same one).
_VOLATILE = frozenset({"stream", "stream_options", "user", "priority", "model"})


def fingerprint(body: dict[str, Any]) -> str:
    """A hash of the request's canonical body (keys sorted, volatile fields dropped)."""
    canon = {k: v for k, v in body.items() if k not in _VOLATILE}
    raw = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass
class _Entry:
    replicas: list[str] = field(default_factory=list)  # the failures under it, by replica, oldest first
    until: float | None = None  # refused until then (monotonic), once quarantined
    seen: float = 0.0  # its last failure: the failures are forgotten ``ttl_s`` after it


class Quarantine:
    def __init__(self, after: int = 2, ttl_s: float = 300.0, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after = after  # 0: off
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently failed first
        self.refusing = 0  # entries in quarantine (the others are failures remembered)
        self.quarantined_total = 0
        self.refused_total = 0

    @property
    def holding(self) -> bool:
        """Something is remembered: requests need their fingerprint checked."""
        if self.entries:
            self._expire()
        return bool(self.entries)

    def left(self, fp: str) -> float | None:
        """Seconds the request ``fp`` is still refused for (None: it may go)."""
        e = self.entries.get(fp)
        if e is None or e.until is None:
            return None
        left = e.until - self.clock()
        if left <= 0:
            self._drop(fp)
            return None
        return left

    def refused(self, fp: str) -> float | None:
        """``left``, counted as a refusal when the request is refused."""
        left = self.left(fp)
        if left is not None:
            self.refused_total += 1
        return left

    def failed(self, fp: str, replica: str) -> bool:
        """A replica failed under request ``fp``; True when that puts (or keeps) it in quarantine."""
        if self.after <= 0:
            return False
        now = self.clock()
        e = self.entries.pop(fp, None) or _Entry()
        e.replicas.append(replica)
        e.seen = now
        self.entries[fp] = e  # to the end: the most recent failure
        if e.until is None and len(e.replicas) >= self.after:
            e.until = now + self.ttl_s
            self.refusing += 1
            self.quarantined_total += 1
        while len(self.entries) > self.max_entries:
            self._drop(next(iter(self.entries)))
        return e.until is not None

    def succeeded(self, fp: str) -> None:
        """Request ``fp`` completed somewhere: its earlier failures were not its doing."""
        e = self.entries.get(fp)
        if e is not None and e.until is None:
            del self.entries[fp]

    def _drop(self, fp: str) -> None:
        if self.entries.pop(fp).until is not None:
            self.refusing -= 1

    def _expire(self) -> None:
        now = self.clock()
        while self.entries:
            fp, e = next(iter(self.entries.items()))
            if e.seen + self.ttl_s > now:  # the oldest failure first: the rest are younger
                break
            self._drop(fp)
