"""Work that waits until the event loop has done what the current turn made ready.

The gateway's latency-critical steps (a new request's first step, a first token) are tasks the loop's current turn
made ready. Work that is due but not urgent (the direct relay's writes, a finished request's record) goes into a
``NextTurn`` batch instead: it is handled two ``call_soon`` hops after the first item came, the first hop running
among this turn's ready work and the second after all of it. ``flush`` handles what waits at once, for whoever must
see it done first. Measured in CHANGELOG.md (2026-12-04, records closed a turn later).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class NextTurn(Generic[T]):
    """Items handed to ``handle`` in arrival order, all together, after the ready work of the turn they came in."""

    __slots__ = ("pending", "_handle", "_due")

    def __init__(self, handle: Callable[[T], None]) -> None:
        self.pending: deque[T] = deque()
        self._handle = handle
        self._due = False

    def add(self, item: T) -> None:
        self.pending.append(item)
        if not self._due:
            self._due = True
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, self._run)

    def _run(self) -> None:
        self._due = False
        self.flush()

    def flush(self) -> None:
        """Handle everything that waits, now (an item ``handle`` raises on stays the caller's to see; the rest wait
        for the next flush)."""
        pending, handle = self.pending, self._handle
        while pending:
            handle(pending.popleft())
