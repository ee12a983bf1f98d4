"""The server's bounded waiting queue: admitted requests that have no first token yet.

Beyond ``capacity`` a request is refused at once with 429 and a ``Retry-After`` estimated from how fast the queue has
been draining, instead of waiting without bound (which only moves the failure into every client's timeout).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailguard.serving.drain import Drain


class Admission:
    def __init__(self, capacity: int, window_s: float = 10.0) -> None:
        self.capacity = capacity
        self.depth = 0  # admitted, waiting for the first token
        self.in_flight = 0  # every request being handled
        self._window = window_s
        self._drained: deque[float] = deque()  # times requests left the queue, for the drain rate
        # Every completion request being handled, by the task that handles it (its ``Exchange``): what a drain on
        # SIGTERM answers at once (not started yet), waits for, or ends (serving/drain.py).
        self.live: dict[asyncio.Task[Any] | None, Any] = {}
        self.drain: Drain | None = None  # set while the server drains: new requests are refused

    def try_enter(self) -> bool:
        if self.depth >= self.capacity:
            return False
        self.depth += 1
        return True

    def leave(self, now: float | None = None) -> None:
        self.depth = max(0, self.depth - 1)
        now = time.monotonic() if now is None else now
        self._drained.append(now)
        cutoff = now - self._window
        while self._drained and self._drained[0] < cutoff:
            self._drained.popleft()

    def retry_after(self, now: float | None = None) -> int:
        """Seconds until the queue has room at the recent drain rate (1..60; 10 when nothing drained lately)."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self._drained if t >= now - self._window]
        if not recent:
            return 10
        rate = len(recent) / self._window
        excess = self.depth - self.capacity + 1
        return int(min(60, max(1, math.ceil(excess / rate))))
