"""Stream QoS (L6): the stall watch and SSE keep-alives around a backend's event stream.

``watch`` passes the backend's events through and, while it waits for the next one, keeps time: before the first
token it wakes every ``keepalive_s`` to let the server send an SSE comment (so that proxies do not cut a long TTFT),
and it counts deadline misses. Each full TTFT deadline (before the first token) or inter-token deadline (after it)
that passes without a token is one miss; a token on time clears the streak, a late one does not. When the streak
reaches ``stall_misses`` the stream is declared stalled: the backend's stream is closed (which aborts the request)
and ``Stalled`` is raised for the server to finish the answer degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

KEEPALIVE: Any = object()  # yielded in place of an event: time for an SSE comment


class Stalled(Exception):
    def __init__(self, misses: int, before_first_token: bool, waited: float) -> None:
        where = "the first token" if before_first_token else "the next token"
        super().__init__(f"{misses} consecutive deadlines missed waiting for {where} ({waited:.2f} s)")
        self.misses = misses
        self.before_first_token = before_first_token


async def watch(events: AsyncIterator[Any], *, ttft_deadline: float | None, itl_deadline: float | None,
                misses: int = 3, keepalive: float | None = None,
                on_miss: Callable[[str], None] | None = None) -> AsyncIterator[Any]:
    it = events.__aiter__()
    first = True
    streak = 0
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(it.__anext__())
            wait_start = time.perf_counter()
            deadline = ttft_deadline if first else itl_deadline
            next_miss = wait_start + deadline if deadline else None
            next_ping = wait_start + keepalive if keepalive and first else None
            missed_here = False
            while not pending.done():
                wakes = [t for t in (next_miss, next_ping) if t is not None]
                timeout = max(0.0, min(wakes) - time.perf_counter()) if wakes else None
                await asyncio.wait((pending,), timeout=timeout)
                if pending.done():
                    break
                now = time.perf_counter()
                if next_miss is not None and now >= next_miss:
                    streak += 1
                    missed_here = True
                    if on_miss is not None:
                        on_miss("ttft" if first else "itl")
                    if streak >= misses:
                        raise Stalled(streak, first, now - wait_start)
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
            if getattr(ev, "token_id", None) is not None:
                if not missed_here:
                    streak = 0
                first = False
            yield ev
    finally:
        if pending is not None and not pending.done():
            pending.cancel()  # runs the backend stream's own cleanup (the abort) inside the cancelled step
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()
