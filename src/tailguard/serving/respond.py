"""Answering a completion request from its backend's events: a stream of SSE chunks (paced and flushed per the
lane, through the direct relay where the gateway has one), a whole JSON body, or the degradation template without
the backend. The timeline takes each event as it is answered: first token, token times, the final event's counts,
the time each token went out; a client gone mid-answer, or a stream that stalled, ends the record where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from tailguard.backends.stall_watch import KEEPALIVE, Stalled
from tailguard.backends.upstream.events import UpstreamEvent
from tailguard.engine.events import TokenEvent
from tailguard.engine.sequence import FinishReason
from tailguard.observe.gateway_metrics import GatewayMetrics
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.serving.client_relay import ClientRelay
from tailguard.serving.exchange import SSE_HEADERS, Exchange, Phase, degraded_headers, degraded_marker
from tailguard.serving.passthrough import Reassembly
from tailguard.serving.protocol import Parsed
from tailguard.serving.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    chat_logprobs,
    completion_logprobs,
)
from tailguard.serving.state import ServerState
from tailguard.serving.tools import CallStream, call_of, tool_call_delta

perf_counter = time.perf_counter
# With ``flush_every`` and no pace: held tokens leave at the latest this long after the last chunk (the gap users
# notice in a stream).
FLUSH_TIMER_S = 0.15

_UPSTREAM_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


class FallbackRecord:
    """What a stall fallback did, in the record (the answer is marked degraded, mode ``fallback``; the gateway
    section's ``fallback`` says from which replica, after how many tokens, to which, and how it ended) and metrics."""

    def __init__(self, tl: Timeline, gm: GatewayMetrics | None) -> None:
        self.tl, self.gm = tl, gm

    def _entry(self) -> dict[str, Any]:
        g = self.tl.gateway = self.tl.gateway or {}
        return g.setdefault("fallback", {})

    def switched(self, stalled_on: str | None, sent_tokens: int, stalled: Stalled) -> None:
        tl = self.tl
        prev = tl.slo_action
        tl.slo_action = {"action": "degrade", "mode": "fallback", "tier": "stream", "scope": f"lane:{tl.lane}",
                         "action_id": "stall-fallback", "reason": f"{stalled}; continued on another replica"}
        if prev is not None and prev.get("mode") == "truncate":  # the red cap still holds: keep saying so
            tl.slo_action.update({k: prev[k] for k in ("max_tokens", "requested_max_tokens") if k in prev},
                                 truncated_by=prev.get("action_id"))
        self._entry().update({"from": stalled_on, "after_tokens": sent_tokens})
        if self.gm is not None and stalled_on is not None:
            self.gm.up_stalls.labels(self.gm.model, stalled_on).inc()

    def finished(self, outcome: str, replica: str | None) -> None:
        entry = self._entry()
        entry["outcome"] = outcome
        if replica is not None:
            entry["to"] = replica
        gm = self.gm
        if gm is not None and outcome == "stalled" and replica is not None:
            gm.up_stalls.labels(gm.model, replica).inc()
        if gm is not None:
            gm.fallbacks.labels(gm.model, self.tl.lane, outcome).inc()
            if outcome == "ok":  # a template ending is counted where the template is written
                gm.degraded.labels(gm.model, self.tl.lane).inc()


class Responder:
    """Writes the answers of one endpoint (``chat``: /v1/chat/completions)."""

    def __init__(self, state: ServerState, chat: bool) -> None:
        self.state = state
        self.chat = chat

    def stalled(self, ex: Exchange, exc: Stalled) -> str:
        """Mark the answer degraded after a stall; returns the text that ends it."""
        tl = ex.tl
        assert ex.decision.lane is not None
        tl.slo_action = {"action": "degrade", "mode": "stall", "tier": "stream", "scope": f"lane:{tl.lane}",
                         "action_id": "stall", "reason": str(exc)}
        gm = self.state.gateway_metrics
        if gm is not None:
            gm.degraded.labels(gm.model, tl.lane).inc()
        return ex.decision.lane.degrade_text

    def abandoned(self, ex: Exchange, final: TokenEvent | None) -> None:
        """The client left before the answer was complete: the record says where the request was at that moment.

        ``final``: the engine's last event (after the abort), which carries when the request was first scheduled and
        produced its first token; only what had happened by the time the client left is taken.
        """
        tl, gone = ex.tl, ex.gone_at
        assert gone is not None
        if final is not None:
            if final.first_scheduled is not None and final.first_scheduled <= gone and tl.scheduled is None:
                tl.scheduled = final.first_scheduled
            if final.first_token is not None and final.first_token <= gone and tl.first_token is None:
                tl.first_token = final.first_token
        ex.move(Phase.CLOSED)
        tl.error = "client disconnected"
        tl.finalize(499, Outcome.ABORTED, at=gone)

    def _take(self, ex: Exchange, ev: TokenEvent, lp_items: list | None) -> bool:
        """Put one engine event on the timeline (and its logprobs in ``lp_items`` and the audit); True for a token."""
        tl = ex.tl
        if ex.phase is Phase.QUEUED:
            ex.move(Phase.RESPONDING if ex.started else Phase.GENERATING)
            if ev.token_id is not None:
                tl.first_token = ev.time
        if ev.token_id is None:
            return False
        tl.token_times.append(ev.time)
        if ex.audit_ids is not None:
            ex.audit_ids.append(ev.token_id)
        if ex.output_ids is not None:
            ex.output_ids.append(ev.token_id)
        if lp_items is not None:
            lp_items.append((ev.token_id, ev.logprob, ev.top_logprobs))
            if tl.logprobs is not None:
                tl.logprobs.append({"id": ev.token_id, "logprob": ev.logprob, "top": ev.top_logprobs})
        return True

    def _format(self, tl: Timeline, p: Parsed) -> ChatFormat | CompletionFormat:
        return (ChatFormat if self.chat else CompletionFormat)(tl.request_id, p.model, int(time.time()))

    @staticmethod
    def _final(tl: Timeline, ev: TokenEvent) -> str:
        tl.last_token = ev.time
        if ev.first_scheduled is not None:
            tl.scheduled = ev.first_scheduled
        if ev.first_token is not None:
            tl.first_token = ev.first_token
        tl.num_prompt_tokens = ev.num_prompt_tokens or tl.num_prompt_tokens
        tl.num_output_tokens = ev.num_output_tokens or len(tl.token_times)
        tl.num_preemptions = getattr(ev, "num_preemptions", 0)
        tl.cached_prompt_tokens = getattr(ev, "num_cached_tokens", 0)
        tl.spec_proposed = getattr(ev, "num_spec_proposed", 0)
        tl.spec_accepted = getattr(ev, "num_spec_accepted", 0)
        tl.internals = getattr(ev, "internals", None)
        fr = ev.finish_reason
        reason = fr.value if isinstance(fr, FinishReason) else str(fr)
        replica = getattr(ev, "replica", None)
        if replica is not None:  # an upstream's answer: which replica, after how many tries
            g = tl.gateway = tl.gateway or {}
            g["replica"] = replica
            g["attempts"] = getattr(ev, "attempts", 1)
            sent = getattr(ev, "sent", None)
            if sent is not None:  # the TTFT split: the gateway's own time before the replica, then the replica's
                g["upstream_sent"] = round(sent - tl.received, 6)
                if ev.first_token is not None:
                    g["upstream_ttft"] = round(ev.first_token - sent, 6)
            if isinstance(ev, UpstreamEvent):
                if ev.usage:
                    tl.upstream_usage = ev.usage
                if ev.reasoning_chunks:
                    g["reasoning_tokens"] = ev.reasoning_chunks  # tokens of reasoning, not of the answer
            if reason in _UPSTREAM_REASONS:
                tl.finish_reason = reason
                return reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"the engine ended the request with finish reason {reason!r}")
        tl.finish_reason = reason
        return reason

    @staticmethod
    def _usage(tl: Timeline) -> dict[str, Any]:
        """What was really produced: the engine's count (a template answer counts none); an upstream's usage as it
        reported it (its token details included), the counts being the same."""
        counts = {"prompt_tokens": tl.num_prompt_tokens, "completion_tokens": tl.num_output_tokens,
                  "total_tokens": tl.num_prompt_tokens + tl.num_output_tokens}
        if tl.upstream_usage is not None:  # the counts are the whole answer's (a stall fallback's two parts)
            return {**tl.upstream_usage, **counts}
        usage: dict[str, Any] = counts
        if tl.cached_prompt_tokens:  # as OpenAI and vLLM report prefix cache hits
            usage["prompt_tokens_details"] = {"cached_tokens": tl.cached_prompt_tokens}
        return usage

    @staticmethod
    def _extra(tl: Timeline) -> dict[str, Any]:
        """The top-level fields of the last chunk or of the body: the ``tailguard`` object (stage times, and
        ``degraded`` for an answer the SLO monitor changed) and, when degraded, a marked ``system_fingerprint``."""
        marker = degraded_marker(tl)
        return {"tailguard": tl.stage_object(), **({"system_fingerprint": marker} if marker else {})}

    def _logprobs(self, items: list, offset: int = 0) -> dict:
        tt = self.state.token_text
        assert tt is not None
        if self.chat:
            return chat_logprobs(tt, items)
        return completion_logprobs(tt, items, offset)

    async def stream(self, ex: Exchange, p: Parsed, events: AsyncIterator[TokenEvent]) -> None:
        tl = ex.tl
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        keep_text = self.state.config.store_text
        lane = ex.decision.lane
        # Pacing (L6): after the first token, a chunk leaves when the lane's inter-token budget has passed since the
        # last one or ``flush_every`` tokens are waiting; the tokens in between go together.
        pace = lane.pace_itl_s if lane is not None and not want_lp else None
        flush_every = lane.flush_every if lane is not None and not want_lp else 1
        pending = 0  # tokens produced but not yet sent (a token may carry no visible text yet)
        held: list[str] = []  # text held back by pacing
        held_n: list[int] = []  # with pacing: the tokens each held text carries
        reserve = lane.pace_reserve if pace is not None and lane is not None else 0
        last_sent = 0.0
        lp_items: list = []
        offset = 0
        final = None
        stalled: str | None = None
        role_sent = False
        sending: int | None = None  # the tokens the chunk being written carries (None: every pending one)

        async def start() -> None:
            if not ex.started:
                await ex.start(200, SSE_HEADERS + degraded_headers(tl))

        def count_stream() -> None:
            gm = self.state.gateway_metrics
            if gm is not None:  # the denominator of the stream interruption rate
                gm.child(gm.streams, tl.lane).inc()

        def role() -> bytes:
            return fmt.role(system_fingerprint=degraded_marker(tl))

        async def begin() -> bytes:
            nonlocal role_sent
            await start()
            if role_sent:
                return b""
            role_sent = True
            count_stream()
            return role()

        def opening(text: str) -> bytes:  # the first token's write from the upstream's read (``ClientRelay``)
            return role() + fmt.content(text)

        calls = CallStream(p.tools) if p.tools is not None else None  # a call is held until the answer ends
        relay = ex.relay
        if relay is not None:
            relay.bind(tl, fmt.content, ex.output if keep_text else None)
        # Held text leaves within the lane's budget even while the engine is slow: a timer, not the next token.
        flush_after = pace if pace is not None else (FLUSH_TIMER_S if flush_every > 1 else None)
        waiting: asyncio.Future[TokenEvent] | None = None  # the next event, awaited across a timed flush
        it = events.__aiter__()
        try:
            while True:
                if held and flush_after is not None and last_sent:
                    if waiting is None:
                        waiting = asyncio.ensure_future(it.__anext__())
                    left = flush_after - (perf_counter() - last_sent)
                    if left > 0:
                        await asyncio.wait((waiting,), timeout=left)
                    if not waiting.done():
                        if pace is not None:  # the budget is up: one held token fills the silence
                            text, n = held.pop(0), held_n.pop(0)
                        else:
                            text, n = "".join(held), pending
                            held.clear()
                        await ex.chunk(fmt.content(text))
                        last_sent = perf_counter()
                        tl.add_tokens_sent(n, last_sent)
                        pending -= n
                        continue
                if relay is not None:
                    # Armed only while waiting here, so that a token relayed directly never overtakes one this
                    # loop holds (the wait in a paused send included), and only after the first token went out.
                    relay.armed = role_sent and ex.phase is Phase.RESPONDING
                    # The first token may be written from the read, the status being out and nothing else sent.
                    relay.opening = opening if not role_sent and ex.started and ex.phase is Phase.QUEUED else None
                try:
                    if waiting is not None:
                        next_event, waiting = waiting, None
                        ev = await next_event
                    else:
                        ev = await it.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    if relay is not None:
                        relay.armed = False
                        relay.opening = None
                        relay.settle()  # what it holds leaves before anything this loop writes
                if ev is KEEPALIVE:
                    if ex.phase is not Phase.ABANDONED:
                        await start()
                        await ex.chunk(b": keep-alive\n\n")
                    continue
                if ex.phase is Phase.ABANDONED:
                    if ev.finished:
                        self.abandoned(ex, ev)
                        return
                    continue
                if ev.token_id is None and getattr(ev, "accepted", False):
                    # The replica took the request: the status and headers leave now, as the replica's did, and
                    # the first token goes out with the role chunk alone, in one write. The role chunk itself waits
                    # for the first token (as vLLM sends it), so that a client timing its first SSE event, as some
                    # benchmarks do, still times the first token.
                    await start()
                    continue
                if self._take(ex, ev, lp_items if want_lp else None):
                    pending += 1
                if ev.finished:
                    final = ev
                    break
                text = ev.text
                passed = ev.passthrough
                if not text and passed is None:
                    continue
                if keep_text and text:
                    ex.output.append(text)
                if calls is not None and text:
                    text = calls.feed(text)
                    if not text:
                        continue
                if passed is not None:  # an upstream's tool call, reasoning or logprobs: its fields as written
                    chunk = fmt.passthrough(text, passed)
                    if held:
                        chunk = fmt.content("".join(held)) + chunk
                        held.clear()
                        held_n.clear()
                elif want_lp:
                    chunk = fmt.content_logprobs(text, self._logprobs(lp_items, offset))
                    offset += len(text)
                    lp_items = []
                else:
                    if pace is not None and last_sent:
                        # Smoothing: up to ``reserve`` tokens stay held to fill the next silence; the rest of a
                        # burst leaves now, and so does the oldest once the budget is up.
                        held.append(text)
                        held_n.append(pending - sum(held_n))
                        over = len(held) - reserve
                        if over <= 0 and perf_counter() - last_sent < pace:
                            continue
                        k = max(over, 1)
                        text, sending = "".join(held[:k]), sum(held_n[:k])
                        del held[:k], held_n[:k]
                    elif flush_every > 1 and last_sent:
                        held.append(text)
                        if pending < flush_every:
                            continue
                        text = "".join(held)
                        held.clear()
                    chunk = fmt.content(text)
                if not role_sent and relay is not None and relay.first_sent is not None:
                    # Written from the upstream's read already, with the role chunk: the rest of what it means.
                    role_sent = True
                    count_stream()
                    last_sent = relay.first_sent
                    relayed = pending if passed is None else pending - 1  # this event's chunk is not written yet
                    tl.add_tokens_sent(relayed, last_sent)
                    pending -= relayed
                    g = tl.gateway = tl.gateway or {}
                    g["first_token_direct"] = True
                    if passed is None:
                        continue
                if not role_sent or not ex.started:
                    chunk = await begin() + chunk
                await ex.chunk(chunk)
                last_sent = perf_counter()
                if sending is None:
                    sending = pending
                tl.add_tokens_sent(sending, last_sent)
                pending -= sending
                sending = None
        except Stalled as exc:
            stalled = self.stalled(ex, exc)
        finally:
            if waiting is not None:  # the events' generator must not be running when it is closed
                waiting.cancel()
                with contextlib.suppress(BaseException):
                    await waiting
        if stalled is not None:
            # The backend stopped keeping time: finish now with what was produced, plus the lane's notice.
            now = perf_counter()
            tl.last_token = tl.token_times[-1] if tl.token_times else None
            tl.num_output_tokens = len(tl.token_times)
            tl.finish_reason = "stop"
            body = await begin() + fmt.content("".join(held) + stalled)
            held.clear()
            if keep_text:
                tl.output_text = "".join(ex.output) + stalled
            if p.include_usage:
                body += fmt.finish("", "stop", None) + fmt.usage(self._usage(tl), **self._extra(tl))
            else:
                body += fmt.finish("", "stop", None, **self._extra(tl))
            await ex.last(body + DONE)
            tl.add_tokens_sent(pending, now)
            self._relayed(tl, relay)
            tl.finalize(200, Outcome.SUCCESS, at=now)
            return
        if final is None:
            raise RuntimeError("the engine's stream ended without a final event")
        reason = self._final(tl, final)
        if keep_text and final.text:
            ex.output.append(final.text)
        if keep_text:
            tl.output_text = "".join(ex.output)
        lp = self._logprobs(lp_items, offset) if want_lp and lp_items else None
        last_text = "".join(held) + final.text
        call_chunk = b""
        if calls is not None:
            last_text, call = calls.finish(last_text)
            if call is not None and isinstance(fmt, ChatFormat):  # tools come only with chat
                tl.finish_reason = reason = "tool_calls"
                call_chunk = fmt.tool_call(tool_call_delta(call, tl.request_id))
        if p.include_usage:
            body = call_chunk + fmt.finish(last_text, reason, lp) + fmt.usage(self._usage(tl), **self._extra(tl))
        else:
            body = call_chunk + fmt.finish(last_text, reason, lp, **self._extra(tl))
        if not role_sent or not ex.started:
            body = await begin() + body
        await ex.last(body + DONE)
        now = perf_counter()
        tl.add_tokens_sent(pending, now)
        self._relayed(tl, relay)
        tl.finalize(200, Outcome.SUCCESS, at=now)

    @staticmethod
    def _relayed(tl: Timeline, relay: ClientRelay | None) -> None:
        """The record's ``gateway.direct_tokens``: the tokens the direct relay wrote, every attempt's together."""
        if relay is not None and relay.taken:
            g = tl.gateway = tl.gateway or {}
            g["direct_tokens"] = relay.taken

    async def full(self, ex: Exchange, p: Parsed, events: AsyncIterator[TokenEvent]) -> None:
        tl = ex.tl
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        texts: list[str] = []
        lp_items: list = []
        passed = Reassembly()
        final = None
        stalled: str | None = None
        try:
            async for ev in events:
                if ev is KEEPALIVE or getattr(ev, "accepted", False):
                    continue
                if ex.phase is Phase.ABANDONED:
                    if ev.finished:
                        self.abandoned(ex, ev)
                        return
                    continue
                self._take(ex, ev, lp_items if want_lp else None)
                if ev.text:
                    texts.append(ev.text)
                if ev.passthrough is not None:
                    passed.add(ev.passthrough)
                if ev.finished:
                    final = ev
                    break
        except Stalled as exc:
            stalled = self.stalled(ex, exc)
        if stalled is not None:
            tl.last_token = tl.token_times[-1] if tl.token_times else None
            tl.num_output_tokens = len(tl.token_times)
            tl.finish_reason = reason = "stop"
            texts.append(stalled)
        elif final is None:
            raise RuntimeError("the engine's stream ended without a final event")
        else:
            reason = self._final(tl, final)
        text = "".join(texts)
        if self.state.config.store_text:
            tl.output_text = text
        lp = self._logprobs(lp_items) if want_lp else passed.logprobs
        message = passed.message_fields()
        call = call_of(text, p.tools) if p.tools is not None and stalled is None else None
        if call is not None:  # the answer is a function call: OpenAI's shape, no text
            tl.finish_reason = reason = "tool_calls"
            text = ""
            message = {"tool_calls": [{k: v for k, v in tool_call_delta(call, tl.request_id).items() if k != "index"}]}
        obj = fmt.full(text, reason, self._usage(tl), lp, message, **self._extra(tl))
        body = json.dumps(obj, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"server-timing", tl.server_timing().encode()), *degraded_headers(tl)]
        await ex.start(200, headers)
        await ex.last(body)
        tl.finalize(200, Outcome.SUCCESS)

    async def template(self, ex: Exchange, p: Parsed, text: str) -> None:
        """Red: answer with the degradation template, without the engine (and without a queue slot).

        Marked in the body (``system_fingerprint: tailguard-degraded:template`` and ``tailguard.degraded``), and its
        usage counts no completion tokens: the model produced none.
        """
        tl = ex.tl
        now = perf_counter()
        tl.synthetic = True  # counted as a degraded answer, never as a latency sample
        tl.scheduled = tl.first_token = tl.last_token = now
        tl.num_output_tokens = 0
        tl.finish_reason = "stop"
        if self.state.config.store_text:
            tl.output_text = text
        fmt = self._format(tl, p)
        marker = degraded_marker(tl)
        if p.stream:
            await ex.start(200, SSE_HEADERS + degraded_headers(tl))
            tail = fmt.finish("", "stop", None, **self._extra(tl)) if not p.include_usage else (
                fmt.finish("", "stop", None) + fmt.usage(self._usage(tl), **self._extra(tl)))
            await ex.last(fmt.role(system_fingerprint=marker) + fmt.content(text) + tail + DONE)
        else:
            obj = fmt.full(text, "stop", self._usage(tl), None, **self._extra(tl))
            body = json.dumps(obj, ensure_ascii=False).encode()
            await ex.start(200, [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode()), *degraded_headers(tl)])
            await ex.last(body)
        tl.finalize(200, Outcome.SUCCESS)
