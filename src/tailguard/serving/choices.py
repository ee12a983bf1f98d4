"""Several choices of one request (``n`` > 1): n sequences from one prompt, answered as one response.

Each choice is its own submission to the backend, the embedded engine or an upstream replica alike, seeded
``seed + i`` where the request has a seed (as vLLM seeds its parallel samples). The first goes alone; the others
follow once it has its first token (or has ended), when the prompt is in the prefix cache: their prompt's full KV
blocks are taken from there, not computed again. Behind the gateway each choice is asked of the replicas for one
choice (``n`` and ``best_of`` leave its body), which lets the gateway watch, count and record every choice's tokens
as it does a single answer's; prefix routing sends them to the first's replica, whose prefix cache does the same.

The timeline follows choice 0: its first token, token times and send times are the request's TTFT and inter-token
latencies (what one stream of the answer looks like), while the output token count, the usage and the tokens charged
to the caller are all choices' together. A lane's pacing and the direct relay apply to single answers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from tailguard.backends.base import Backend, Submission, Submitted
from tailguard.backends.stall_watch import KEEPALIVE, Stalled
from tailguard.engine.events import TokenEvent
from tailguard.engine.sequence import FinishReason
from tailguard.observe.timeline import Outcome
from tailguard.serving.exchange import SSE_HEADERS, Exchange, Phase, degraded_headers, degraded_marker
from tailguard.serving.passthrough import Reassembly
from tailguard.serving.protocol import Parsed
from tailguard.serving.respond import _UPSTREAM_REASONS, Responder
from tailguard.serving.responses import DONE, ChatFormat
from tailguard.serving.tools import CallStream, call_of, tool_call_delta

perf_counter = time.perf_counter
_SEED_MAX = 2**64 - 1


def _choice_seed(seed: int, i: int) -> int:
    """Choice ``i``'s seed: ``seed + i``, kept in the range a seed may take."""
    return seed + i if seed + i <= _SEED_MAX else seed - i


def choice_submissions(first: Submission, n: int) -> list[Submission]:
    """The ``n`` submissions of one request's choices; ``first`` (choice 0) keeps its id, the others get ``/i``."""
    body = {k: v for k, v in first.body.items() if k not in ("n", "best_of")}
    first.body = body
    subs = [first]
    for i in range(1, n):
        sampling = copy.copy(first.sampling)
        choice_body = dict(body)
        if sampling.seed is not None:
            sampling.seed = _choice_seed(sampling.seed, i)
        if type(body.get("seed")) is int:
            choice_body["seed"] = _choice_seed(body["seed"], i)
        # No direct relay and no stall fallback: both follow one answer's stream.
        subs.append(replace(first, request_id=f"{first.request_id}/{i}", sampling=sampling, body=choice_body,
                            relay=None, fallback=None))
    return subs


class Choices:
    """The choices' submissions, their token events merged in arrival order as ``(index, event)``. Closing the
    merged stream early (client gone, a failure) closes every choice's, which aborts them in the backend."""

    def __init__(self, backend: Backend, subs: list[Submission], wanted: Callable[[], bool]) -> None:
        self.backend = backend
        self.subs = subs
        self.ids = [s.request_id for s in subs]
        self.wanted = wanted
        self._submitted: list[Submitted] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

    def _start(self, i: int) -> None:
        submitted = self.backend.submit(self.subs[i])
        self._submitted.append(submitted)
        self._tasks.append(asyncio.ensure_future(self._pump(i, submitted.events)))

    async def _pump(self, i: int, events: AsyncGenerator[TokenEvent, None]) -> None:
        put = self._queue.put_nowait
        try:
            async with aclosing(events):
                async for ev in events:
                    put((i, ev))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it as the request's
            put((i, exc))
            return
        put((i, None))

    async def events(self) -> AsyncGenerator[tuple[int, TokenEvent], None]:
        n = len(self.subs)
        try:
            self._start(0)
            ended, rest_started = 0, n == 1
            while ended < len(self._tasks):
                i, item = await self._queue.get()
                if item is None:
                    ended += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                if not rest_started and i == 0 and (item.token_id is not None or item.finished):
                    rest_started = True  # choice 0's prompt is computed (and cached): the others share it
                    if self.wanted():
                        for j in range(1, n):
                            self._start(j)
                yield i, item
        finally:
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(BaseException):
                    await task

    def abort(self) -> None:
        for rid in self.ids:
            self.backend.abort(rid)

    def release(self) -> None:
        for submitted in self._submitted:
            submitted.release()


@dataclass(slots=True)
class _Choice:
    index: int
    calls: CallStream | None
    texts: list[str] = field(default_factory=list)
    lp_items: list = field(default_factory=list)
    offset: int = 0
    tokens: int = 0
    role_sent: bool = False
    passed: Reassembly = field(default_factory=Reassembly)
    final: TokenEvent | None = None


def _reason(ev: TokenEvent) -> str:
    fr = ev.finish_reason
    reason = fr.value if isinstance(fr, FinishReason) else str(fr)
    if reason in ("stop", "length") or (getattr(ev, "replica", None) is not None and reason in _UPSTREAM_REASONS):
        return reason
    raise RuntimeError(f"the backend ended a choice with finish reason {reason!r}")


class ChoicesResponder:
    """Writes the answer of a request with several choices, streamed (each chunk with its choice's ``index``) or
    whole (``choices`` in index order), with the single answer's ``Responder`` for what they share."""

    def __init__(self, answers: Responder) -> None:
        self.answers = answers

    def _setup(self, ex: Exchange, p: Parsed) -> list[_Choice]:
        return [_Choice(i, CallStream(p.tools) if p.tools is not None else None) for i in range(p.n)]

    def _take(self, ex: Exchange, c: _Choice, ev: TokenEvent, want_lp: bool) -> bool:
        """Put one event on its choice (and choice 0's on the timeline); True when it ends the choice."""
        if ev.token_id is not None:
            c.tokens += 1
        if c.index == 0:  # the request's timeline follows choice 0
            self.answers._take(ex, ev, c.lp_items if want_lp else None)
        elif want_lp and ev.token_id is not None:
            c.lp_items.append((ev.token_id, ev.logprob, ev.top_logprobs))
        if ev.text:
            c.texts.append(ev.text)
        if ev.finished:
            c.final = ev
        return ev.finished

    def _close(self, ex: Exchange, choices: list[_Choice], stalled: str | None) -> list[str]:
        """The timeline's figures once every choice has ended (or the stream stalled); returns each finish reason."""
        tl = ex.tl
        first = choices[0].final
        if first is not None:
            self.answers._final(tl, first)
        else:  # stalled before choice 0 ended
            tl.last_token = tl.token_times[-1] if tl.token_times else None
            tl.finish_reason = "stop"
        reasons = [_reason(c.final) if c.final is not None else "stop" for c in choices]
        produced = [max(c.final.num_output_tokens if c.final is not None else 0, c.tokens) for c in choices]
        tl.num_output_tokens = sum(produced)
        if stalled is not None:
            tl.finish_reason = "stop"
        if self.answers.state.config.store_text:  # the record keeps choice 0's text, as its timing
            tl.output_text = "".join(choices[0].texts) + (stalled or "")
        return reasons

    async def stream(self, ex: Exchange, p: Parsed, merged: AsyncIterator[tuple[int, TokenEvent]]) -> None:
        r, tl = self.answers, ex.tl
        fmt = r._format(tl, p)
        want_lp = p.logprobs is not None
        choices = self._setup(ex, p)
        counted = False

        async def start() -> None:
            if not ex.started:
                await ex.start(200, SSE_HEADERS + degraded_headers(tl))

        def opened(c: _Choice) -> bytes:
            nonlocal counted
            if c.role_sent:
                return b""
            c.role_sent = True
            gm = r.state.gateway_metrics
            if gm is not None and not counted:  # the denominator of the stream interruption rate
                counted = True
                gm.child(gm.streams, tl.lane).inc()
            return fmt.role(system_fingerprint=degraded_marker(tl), index=c.index)

        def finish(c: _Choice, text: str, reason: str, **extra: Any) -> bytes:
            lp = r._logprobs(c.lp_items, c.offset) if want_lp and c.lp_items else None
            call_chunk = b""
            if c.calls is not None:
                text, call = c.calls.finish(text)
                if call is not None and isinstance(fmt, ChatFormat):
                    reason = "tool_calls"
                    delta = tool_call_delta(call, f"{tl.request_id[:21]}-{c.index}")
                    call_chunk = fmt.tool_call(delta, index=c.index)
            return opened(c) + call_chunk + fmt.finish(text, reason, lp, index=c.index, **extra)

        stalled: str | None = None
        ended = 0
        try:
            async for i, ev in merged:
                if ev is KEEPALIVE:
                    if ex.phase is not Phase.ABANDONED:
                        await start()
                        await ex.chunk(b": keep-alive\n\n")
                    continue
                if ex.phase is Phase.ABANDONED:
                    if i == 0 and ev.finished:
                        r.abandoned(ex, ev)
                        return
                    continue
                if ev.token_id is None and getattr(ev, "accepted", False):
                    await start()
                    continue
                c = choices[i]
                if self._take(ex, c, ev, want_lp):
                    ended += 1
                    if ended == p.n:
                        break
                    continue  # its finish chunk leaves at the end, with the others' (one write)
                text, passed = ev.text, ev.passthrough
                if not text and passed is None:
                    continue
                if c.calls is not None and text:
                    text = c.calls.feed(text)
                    if not text:
                        continue
                if passed is not None:
                    chunk = fmt.passthrough(text, passed, index=i)
                elif want_lp:
                    chunk = fmt.content_logprobs(text, r._logprobs(c.lp_items, c.offset), index=i)
                    c.offset += len(text)
                    c.lp_items = []
                else:
                    chunk = fmt.content(text, index=i)
                await start()
                await ex.chunk(opened(c) + chunk)
                unsent = len(tl.token_times) - len(tl.token_sent)
                if i == 0 and unsent > 0:
                    tl.add_tokens_sent(unsent, perf_counter())
        except Stalled as exc:
            stalled = r.stalled(ex, exc)
        reasons = self._close(ex, choices, stalled)
        extra = r._extra(tl)
        body = b""
        for c in choices:
            text = c.final.text if c.final is not None else stalled or ""
            last = c.index == p.n - 1 and not p.include_usage
            body += finish(c, text, reasons[c.index], **(extra if last else {}))
        if p.include_usage:
            body += fmt.usage(r._usage(tl), **extra)
        await start()
        await ex.last(body + DONE)
        now = perf_counter()
        if len(tl.token_times) > len(tl.token_sent):
            tl.add_tokens_sent(len(tl.token_times) - len(tl.token_sent), now)
        tl.finalize(200, Outcome.SUCCESS, at=now)

    async def full(self, ex: Exchange, p: Parsed, merged: AsyncIterator[tuple[int, TokenEvent]]) -> None:
        r, tl = self.answers, ex.tl
        fmt = r._format(tl, p)
        want_lp = p.logprobs is not None
        choices = self._setup(ex, p)
        stalled: str | None = None
        ended = 0
        try:
            async for i, ev in merged:
                if ev is KEEPALIVE or getattr(ev, "accepted", False):
                    continue
                if ex.phase is Phase.ABANDONED:
                    if i == 0 and ev.finished:
                        r.abandoned(ex, ev)
                        return
                    continue
                c = choices[i]
                if ev.passthrough is not None:
                    c.passed.add(ev.passthrough)
                if self._take(ex, c, ev, want_lp):
                    ended += 1
                    if ended == p.n:
                        break
        except Stalled as exc:
            stalled = r.stalled(ex, exc)
        reasons = self._close(ex, choices, stalled)
        out = []
        for c in choices:
            text = "".join(c.texts) + ("" if c.final is not None else stalled or "")
            reason = reasons[c.index]
            lp = r._logprobs(c.lp_items) if want_lp else c.passed.logprobs
            message = c.passed.message_fields()
            call = call_of(text, p.tools) if p.tools is not None and c.final is not None else None
            if call is not None:
                reason, text = "tool_calls", ""
                delta = tool_call_delta(call, f"{tl.request_id[:21]}-{c.index}")
                message = {"tool_calls": [{k: v for k, v in delta.items() if k != "index"}]}
            out.append(fmt.choice(text, reason, lp, message, index=c.index))
        if any(c["finish_reason"] == "tool_calls" for c in out[:1]):
            tl.finish_reason = "tool_calls"
        obj = fmt.full_choices(out, r._usage(tl), **r._extra(tl))
        body = json.dumps(obj, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"server-timing", tl.server_timing().encode()), *degraded_headers(tl)]
        await ex.start(200, headers)
        await ex.last(body)
        tl.finalize(200, Outcome.SUCCESS)
