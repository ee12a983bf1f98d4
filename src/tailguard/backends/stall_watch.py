"""Stream QoS (L6): the stall watch and SSE keep-alives around a backend's event stream.

``watch`` passes the backend's events through and, while it waits for the next one, keeps time: before the first
token it wakes every ``keepalive_s`` to let the server send an SSE comment (so that proxies do not cut a long TTFT),
and it counts deadline misses. Each full TTFT deadline (before the first token) or inter-token deadline (after it)
that passes without a token is one miss; a token on time clears the streak, a late one does not. When the streak
reaches ``stall_misses`` the stream is declared stalled: the backend's stream is closed (which aborts the request)
and ``Stalled`` is raised for the server to finish the answer degraded.

The cost stays per request, not per token: the wait for the first token runs in a task (keep-alives are yielded
while it lasts); after it, events are awaited directly, with one timer for the inter-token deadline that is moved
only when it fires, and with no timer at all when the lane has no inter-token deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from tailguard.engine.events import TokenEvent

# Yielded in place of an event: time for an SSE comment. A token event (no token, no end) known by its identity.
KEEPALIVE = TokenEvent("", None, "", 0.0)


class Stalled(Exception):
    def __init__(self, misses: int, before_first_token: bool, waited: float) -> None:
        where = "the first token" if before_first_token else "the next token"
        super().__init__(f"{misses} consecutive deadlines missed waiting for {where} ({waited:.2f} s)")
        self.misses = misses
        self.before_first_token = before_first_token


async def watch(events: AsyncIterator[TokenEvent], *, ttft_deadline: float | None, itl_deadline: float | None,
                misses: int = 3, keepalive: float | None = None,
                on_miss: Callable[[str], None] | None = None, relay: Any = None) -> AsyncGenerator[TokenEvent, None]:
    """``relay``: the client's direct relay (``serving/client_relay.py``), whose tokens never pass here: it tells the
    inter-token clock of each (``on_token``)."""
    it = events.__aiter__()
    try:
        ev = None
        # Closed explicitly when the caller leaves early: the first phase may hold a running read to cancel.
        async with aclosing(_until_first_token(it, ttft_deadline, misses, keepalive, on_miss)) as first_phase:
            async for ev in first_phase:
                yield ev
        if ev is None or ev is KEEPALIVE or getattr(ev, "finished", False):
            return
        if not itl_deadline:
            async for ev in it:  # nothing to time between tokens: the events pass as they are
                yield ev
            return
        async with aclosing(_between_tokens(it, itl_deadline, misses, on_miss, relay)) as rest:
            async for ev in rest:
                yield ev
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


async def _until_first_token(it: AsyncIterator[TokenEvent], deadline: float | None, misses: int, keepalive: float | None,
                             on_miss: Callable[[str], None] | None) -> AsyncGenerator[TokenEvent, None]:
    """Events up to and with the first token. The wait runs in a task of its own so that keep-alives can be yielded
    while it lasts (once per request: the tokens after it are timed without a task each)."""
    streak = 0
    pending: asyncio.Future | None = None
    # One clock for the whole wait: an event that is not a token (the replica's head, ``accepted``) neither restarts
    # the TTFT deadline nor clears the streak.
    wait_start = time.perf_counter()
    next_miss = wait_start + deadline if deadline else None
    next_ping = wait_start + keepalive if keepalive else None
    try:
        while True:
            pending = asyncio.ensure_future(it.__anext__())
            while not pending.done():
                wakes = [t for t in (next_miss, next_ping) if t is not None]
                timeout = max(0.0, min(wakes) - time.perf_counter()) if wakes else None
                await asyncio.wait((pending,), timeout=timeout)
                if pending.done():
                    break
                now = time.perf_counter()
                if next_miss is not None and now >= next_miss:
                    streak += 1
                    if on_miss is not None:
                        on_miss("ttft")
                    if streak >= misses:
                        raise Stalled(streak, True, now - wait_start)
                    next_miss += deadline  # type: ignore[operator]
                if next_ping is not None and now >= next_ping:
                    next_ping = now + keepalive  # type: ignore[operator]
                    yield KEEPALIVE
            try:
                ev = pending.result()
            except StopAsyncIteration:
                pending = None
                return
            pending = None
            yield ev
            if getattr(ev, "token_id", None) is not None:
                return
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # runs the backend stream's own cleanup (the abort) inside the cancelled step
            with contextlib.suppress(BaseException):
                await pending


async def _between_tokens(it: AsyncIterator[TokenEvent], deadline: float, misses: int,
                          on_miss: Callable[[str], None] | None, relay: Any = None) -> AsyncGenerator[TokenEvent, None]:
    """Events after the first token, each awaited in the caller's own task. One timer keeps the deadlines: it is
    armed once and, when it fires, counts a miss only if the current wait has lasted a full deadline, else moves to
    where that wait's deadline falls; a token costs a clock read, not a task and a timer. At the last miss the timer
    cancels the waiting task, and the cancellation (ours) becomes ``Stalled``."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    waiting = False
    wait_start = 0.0
    missed_here = 0
    streak = 0
    stalled: Stalled | None = None
    timer: asyncio.TimerHandle | None = None

    def fire() -> None:
        nonlocal timer, missed_here, streak, stalled
        timer = None
        if not waiting:
            return  # the caller is busy with the last event: the next wait arms the timer again
        now = loop.time()
        due = wait_start + (missed_here + 1) * deadline
        if now >= due:
            streak += 1
            missed_here += 1
            if on_miss is not None:
                on_miss("itl")
            if streak >= misses:
                stalled = Stalled(streak, False, now - wait_start)
                task.cancel()  # interrupts the wait below, and with it the backend's stream
                return
            due = wait_start + (missed_here + 1) * deadline
        timer = loop.call_at(due, fire)

    def relayed() -> None:
        """A token went by the direct relay during this wait: as if it had come here, and the wait starts again."""
        nonlocal wait_start, missed_here, streak
        if not missed_here:
            streak = 0
        wait_start = loop.time()
        missed_here = 0

    if relay is not None:
        relay.on_token = relayed
    try:
        while True:
            wait_start = loop.time()
            missed_here = 0
            waiting = True
            if timer is None:
                timer = loop.call_at(wait_start + deadline, fire)
            try:
                ev = await it.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if stalled is None:
                    raise
                task.uncancel()
                raise stalled from None
            finally:
                waiting = False
            if getattr(ev, "token_id", None) is not None and not missed_here:
                streak = 0
            yield ev
    finally:
        if relay is not None:
            relay.on_token = None
        if timer is not None:
            timer.cancel()
