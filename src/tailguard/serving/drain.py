"""The drain on SIGTERM (or any stop of the server): every client gets a clean answer, and its record says the same.

uvicorn's own shutdown closes the listener, waits ``timeout_graceful_shutdown`` for every connection, then cancels
what is left: a request still queued got uvicorn's plain-text 500, a stream was cut with no error event and no
``[DONE]``, and the records said "503, cancelled" for both. ``Drain.run`` goes first, with the listener still open:

1. ``/ready`` answers 503 (``draining``), and every new completion request is refused at once with a JSON 503 and
   ``Retry-After`` (``refusal``): a load balancer stops sending, a client retries elsewhere. ``/health`` stays 200.
2. Every request not started yet (waiting for a lane, in the queue or the engine's prefill: no first token) is
   answered at once: a JSON 503 with ``Retry-After``, or, when a stream's status already left (a keep-alive, an
   upstream's head), an SSE error event and ``data: [DONE]``. Recorded 503, ``rejected``.
3. Running requests get ``graceful_shutdown_s`` (the drain timeout) to finish as usual. Whatever still runs then is
   ended: an SSE error event and ``data: [DONE]`` for a stream, a JSON 503 otherwise. Recorded 503, ``error``, with
   the tokens it had sent.

Each is ended by cancelling its task with the answer noted here first; the request's own handler
(``CompletionEndpoint.__call__``) takes the note (``cut_error``), sends the answer and closes the record as for any
error. Then uvicorn's shutdown runs (the listener, the connections, the lifespan: the store flushes every record).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tailguard.api_error import APIError
from tailguard.observe.timeline import Outcome
from tailguard.serving.exchange import Phase

if TYPE_CHECKING:
    from tailguard.serving.admission import Admission

log = logging.getLogger("tailguard.server")

RETRY_AFTER_S = 5  # as for a server still loading its model: a restart takes seconds
CUT_GRACE_S = 5.0  # how long ended requests get to write their last answer (a client not reading may block it)
POLL_S = 0.02


class Drain:
    def __init__(self, admission: Admission, timeout_s: float) -> None:
        self.admission = admission
        self.timeout_s = timeout_s
        self._cut: dict[asyncio.Task[Any], tuple[APIError, Outcome]] = {}  # noted, not yet taken by the handler
        self._ended: set[asyncio.Task[Any]] = set()  # each request is ended once (its answer may still be writing)
        self.counts = {"refused_queued": 0, "finished": 0, "cut_running": 0}

    @staticmethod
    def refusal() -> APIError:
        """The answer to a request that arrives while the server drains."""
        return APIError(503, "the server is shutting down; retry the request (on another replica)",
                        code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})

    def begin(self) -> None:
        """Refuse new requests (and make ``/ready`` say so), and answer every request not started yet."""
        self.admission.drain = self
        queued = APIError(503, "the server is shutting down and this request had not started; retry it (on another "
                               "replica)", code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
        for task, ex in list(self.admission.live.items()):
            if ex.phase < Phase.GENERATING:
                self.counts["refused_queued"] += 1
                self._end(task, queued, Outcome.REJECTED)

    async def run(self, stop_waiting: Callable[[], bool] = lambda: False) -> None:
        """``begin``, wait for the running requests up to the drain timeout, end the rest; ``stop_waiting``: give up
        waiting (a second Ctrl+C)."""
        started = time.monotonic()
        live = self.admission.live
        running = len(live)
        self.begin()
        if live:
            log.info("draining: %d requests running, %d answered 503 before they started; waiting up to %g s",
                     len(live) - self.counts["refused_queued"], self.counts["refused_queued"], self.timeout_s)
        await self._wait(started + self.timeout_s, stop_waiting)
        if live:
            cut = APIError(503, f"the server is shutting down: this answer was ended after the {self.timeout_s:g} s "
                                "drain timeout", code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
            for task in list(live):
                if task not in self._ended:
                    self.counts["cut_running"] += 1
                    self._end(task, cut, Outcome.ERROR)
            log.warning("draining: %d requests still running after %g s were ended", self.counts["cut_running"],
                        self.timeout_s)
            await self._wait(time.monotonic() + CUT_GRACE_S, stop_waiting)
        self.counts["finished"] = max(0, running - self.counts["refused_queued"] - self.counts["cut_running"])

    async def _wait(self, deadline: float, stop_waiting: Callable[[], bool]) -> None:
        live = self.admission.live
        while live and time.monotonic() < deadline and not stop_waiting():
            await asyncio.sleep(POLL_S)

    def _end(self, task: asyncio.Task[Any] | None, err: APIError, outcome: Outcome) -> None:
        if task is None or task.done() or task in self._ended:
            return
        self._ended.add(task)
        self._cut[task] = (err, outcome)
        task.cancel()

    def cut_error(self) -> tuple[APIError, Outcome] | None:
        """In a request's handler that caught a cancellation: the answer and outcome the drain ended it with (and the
        cancellation is taken back), or None when the cancellation is someone else's."""
        task = asyncio.current_task()
        got = self._cut.pop(task, None) if task is not None else None
        if got is not None and task is not None:
            task.uncancel()
        return got
