"""Python's cycle collector on the server's own schedule, not the allocator's.

The collector stops the event loop (and, holding the GIL, every thread's Python work) while it runs. With its default
thresholds (700, 10, 10) the gateway at 256 streams paused 10-40 ms about once a second (726 ms of collections in
35 s, measured with ``gc.callbacks``), most of its added P99 TTFT. Raising the thresholds (10,000, 50, 100) did not
cure it: the young generation's counter is net allocations, and every older object freed takes one off it, so under
a steady load the young list grew to 60,000 live objects of in-flight streams (coroutines, closures, contexts) before
a "young" collection ran, and each one then scanned them all: 20-50 ms pauses every few seconds (benchmarks/
gateway_overhead.py, docs/gateway.md).

Reference counting frees almost everything a request allocates the moment it is done; the collector is only needed
for reference cycles, which a serving process makes few of. So a process that is the server's alone
(``tailguard serve``) freezes what exists once the backend is attached (modules, the model, the app: never scanned
again), turns automatic collection off, and collects on a timer instead: a full collection every ``interval_s``
(60 s), or sooner once ``new_objects`` net new tracked objects have accumulated (a sign that cycles pile up, or of a
much larger load). One pause a minute, of the order of the live objects (a collection scanning the 60,000 of 256
streams took 20-50 ms on this machine class), touches ~0.2% of requests at that load instead of one request in ten; the pauses are counted and
timed (``stats``, and the server's ``tailguard_gc_pause_seconds``) and logged at debug level.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("tailguard.server")


@dataclass
class CollectorStats:
    collections: int = 0
    collected: int = 0  # objects found unreachable
    max_pause_s: float = 0.0


class ScheduledCollector:
    def __init__(self, interval_s: float = 60.0, new_objects: int = 200_000, check_s: float = 1.0,
                 on_collect: Callable[[float, int], None] | None = None) -> None:
        if interval_s <= 0 or check_s <= 0 or new_objects <= 0:
            raise ValueError("interval_s, check_s and new_objects must be positive")
        self.interval_s = interval_s
        self.new_objects = new_objects
        self.check_s = check_s
        self.on_collect = on_collect  # (pause seconds, objects found unreachable): the server's metrics
        self.stats = CollectorStats()
        self._last = time.monotonic()
        self._was_enabled: bool | None = None

    def install(self) -> None:
        """Collect once, freeze the survivors (start-up objects live as long as the process) and stop automatic
        collection. ``uninstall`` undoes it (tests; a process that hands the collector back)."""
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        self._last = time.monotonic()

    def uninstall(self) -> None:
        if self._was_enabled is None:
            return
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return now - self._last >= self.interval_s or gc.get_count()[0] >= self.new_objects

    def collect(self) -> int:
        """One full collection now; returns the objects it found unreachable."""
        start = time.perf_counter()
        found = gc.collect()
        pause = time.perf_counter() - start
        self._last = time.monotonic()
        s = self.stats
        s.collections += 1
        s.collected += found
        s.max_pause_s = max(s.max_pause_s, pause)
        log.debug("gc: %d unreachable objects collected in %.1f ms", found, pause * 1e3)
        if self.on_collect is not None:
            self.on_collect(pause, found)
        return found

    async def run(self) -> None:
        """The timer, on the event loop (a collection must not interleave with the loop's own work anyway)."""
        while True:
            await asyncio.sleep(self.check_s)
            if self.due():
                self.collect()
