"""Stall fallback: a stream that stalled at one upstream replica carries on at another.

The request goes out as usual, under the lane's stall watch. When the watch declares the stream stalled (its
``stall_misses`` consecutive deadlines missed), the stalled replica's stream is closed (the abort there) and the
answer continues as a continuation request on another replica (``continuation_body``: the prompt, or the
conversation, with the text already sent; ``max_tokens`` less the tokens already sent; before the first token, the
request as it was). The client's stream goes on unchanged: the continuation's tokens are the same kind of events, so
the server sends them under the same id, in the same SSE stream, with no second role chunk.

The continuation is watched too. If no other replica is available, or the continuation fails before its first
token, or stalls as well, the original ``Stalled`` (or the new one) reaches the server, which ends the answer with
the lane's template as it does without a fallback. ``report`` tells the server what happened, for the record and the
metrics. Each stall counts as a failure for the stalled replica's circuit breaker.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailguard.backends.base import FallbackReport
from tailguard.backends.stall_watch import Stalled
from tailguard.backends.upstream.events import Opening, UpstreamError, UpstreamEvent, continuation_body
from tailguard.backends.upstream.relay import Relay
from tailguard.engine.events import TokenEvent

perf_counter = time.perf_counter


@dataclass
class UpstreamRequest:
    """What ``UpstreamBackend.generate_request`` is called with, kept to send the request again."""

    body: dict[str, Any]
    chat: bool
    request_id: str
    max_tokens: int  # the request's effective limit (the continuation gets what is left of it)
    priority: int = 0
    est_tokens: int = 0
    affinity_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    relay: Relay | None = None  # the client's direct relay of plain tokens (``backends/upstream/relay.py``), when it has one
    opening: Opening | None = None  # the first attempt, written already (``UpstreamBackend.open``): the first send's

    def send(self, backend: Sender, body: dict[str, Any] | None = None, est_tokens: int | None = None,
             tried: list[str] | None = None, exclude: set[str] | None = None) -> AsyncGenerator[UpstreamEvent, None]:
        """The backend's event stream for this request (or for ``body``, a continuation of it)."""
        opening = None
        if body is None and exclude is None:
            opening, self.opening = self.opening, None
        return backend.generate_request(
            self.body if body is None else body, self.chat, self.request_id, priority=self.priority,
            est_tokens=self.est_tokens if est_tokens is None else est_tokens, affinity_key=self.affinity_key,
            headers=self.headers, tried=tried, exclude=exclude, relay=self.relay, opening=opening, origin=self.body)


class Sender(Protocol):
    """What the fallback needs of the upstream backend (``proxy.UpstreamBackend``)."""

    def generate_request(self, body: dict[str, Any], chat: bool, request_id: str, *, priority: int = 0,
                         est_tokens: int = 0, affinity_key: str | None = None,
                         headers: dict[str, str] | None = None, tried: list[str] | None = None,
                         exclude: set[str] | None = None, relay: Relay | None = None,
                         opening: Opening | None = None,
                         origin: dict[str, Any] | None = None) -> AsyncGenerator[UpstreamEvent, None]: ...

    def stalled(self, name: str | None) -> None: ...


async def stall_fallback(backend: Sender, request: UpstreamRequest,
                         guard: Callable[[AsyncIterator[TokenEvent]], AsyncGenerator[TokenEvent, None]],
                         report: FallbackReport, wanted: Callable[[], bool] = lambda: True) -> AsyncGenerator[TokenEvent, None]:
    """The request's events, through ``guard`` (the stall watch); after a stall, the continuation's events.
    ``wanted``: False once the client has gone (no continuation is sent for nobody)."""
    tried: list[str] = []
    texts: list[str] = []  # every text sent, in order: the stream's and the direct relay's (its ``sink``)
    relay = request.relay
    if relay is not None:
        relay.sink = texts
    first = guard(request.send(backend, tried=tried))
    try:
        async with aclosing(first):
            async for ev in first:
                if getattr(ev, "token_id", None) is not None:
                    texts.append(ev.text)
                yield ev
        return
    except Stalled as exc:
        stalled = exc
    finally:
        if relay is not None:
            relay.sink = None
    sent = len(texts)
    stalled_on = tried[-1] if tried else None
    backend.stalled(stalled_on)
    if sent >= request.max_tokens:  # every token had come: only the stream's end was missing
        yield UpstreamEvent(request.request_id, None, "", perf_counter(), finished=True,
                            finish_reason="length", num_output_tokens=sent,  # type: ignore[arg-type]
                            replica=stalled_on, attempts=len(tried))
        return
    if not wanted():
        raise stalled
    body = continuation_body(request.body, request.chat, "".join(texts), sent, request.max_tokens)
    if body is None:
        report.finished("not_continuable", None)
        raise stalled
    report.switched(stalled_on, sent, stalled)
    again: list[str] = []
    second = guard(request.send(backend, body, est_tokens=max(0, request.est_tokens - sent), tried=again,
                                exclude=set(tried)))
    produced = False
    try:
        async with aclosing(second):
            async for ev in second:
                if ev.token_id is not None:
                    produced = True
                if ev.finished and isinstance(ev, UpstreamEvent):  # a replica's final event (never a keep-alive)
                    _whole_answer(ev, sent, len(tried))
                    report.finished("ok", ev.replica)
                yield ev
    except Stalled:
        backend.stalled(again[-1] if again else None)
        report.finished("stalled", again[-1] if again else None)
        raise
    except UpstreamError as exc:
        if produced:
            report.finished("interrupted", again[-1] if again else None)
            raise
        report.finished("no_replica" if exc.code == "no_upstream" else "failed", again[-1] if again else None)
        raise stalled from exc


def _whole_answer(ev: UpstreamEvent, sent: int, attempts_before: int) -> None:
    """The continuation's final event, made to describe the whole answer: its tokens include those sent before the
    switch; its prompt held them (an estimate: the upstream tokenized the sent text again); the answer's first token
    came from the stalled replica when any had come."""
    ev.attempts += attempts_before
    if not sent:
        return
    ev.num_output_tokens += sent
    ev.num_prompt_tokens = max(0, ev.num_prompt_tokens - sent)
    ev.first_token = None
