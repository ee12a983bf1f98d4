"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request, one state machine.

An exchange moves through ``Phase`` in one direction: RECEIVED (read, validate, tokenize; no queue slot) -> QUEUED
(holds an admission slot, handed to the engine) -> GENERATING (the engine's first event came back) -> RESPONDING
(the engine answered and the response headers are out) -> CLOSED (the last byte handed over, or the exchange ended
any other way), or ABANDONED (the client left first). ``Exchange.move`` is the only place a queue slot is given back,
whatever ends the wait. The headers may leave before RESPONDING (``Exchange.started``): a stream's status and
headers go out when an upstream replica accepts the request (its 200 head, before its first token, as the replica
sent them) or with a keep-alive; the request keeps its queue slot until the engine's first event all the same.

While the engine works, Starlette's disconnect listener runs beside the response the way ``StreamingResponse`` runs
it (one task group, cancelled when either side ends): it notices the client going away during the queue wait and
prefill as well as mid-stream. On that signal the request is aborted in the engine, and the response gets a moment
(``ABORT_REPORT_WAIT_S``) to read the engine's final event, which tells where the request was (scheduled, first
token), before it is cancelled.

Every exit, success or failure, funnels through one ``finally`` that closes the timeline exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tailguard.engine.request import EngineClosed, RequestError, SamplingParams, SequenceFailed
from tailguard.gateway.fallback import UpstreamRequest, stall_fallback
from tailguard.gateway.lanes import LaneConfig, Overloaded
from tailguard.gateway.proxy import UpstreamError
from tailguard.gateway.streams import KEEPALIVE, Stalled, watch
from tailguard.gateway.tenants import RateLimited
from tailguard.observe.metrics import clean_label
from tailguard.observe.timeline import Outcome, Timeline
from tailguard.serving.chat_prompt import render_chat_prompt
from tailguard.serving.client_relay import ClientRelay
from tailguard.serving.errors import APIError
from tailguard.serving.ids import request_id_from
from tailguard.serving.protocol import Parsed, decode_json, parse_chat, parse_completion
from tailguard.serving.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    chat_logprobs,
    completion_logprobs,
    sse_error,
)
from tailguard.serving.state import ServerState

if TYPE_CHECKING:
    from tailguard.engine.engine import TokenEvent
    from tailguard.serving.backend import Backend, Tokenizer
    from tailguard.slo.actions import Degradation

log = logging.getLogger("tailguard.server")
perf_counter = time.perf_counter

# How long an aborted request waits for the engine's final event (its timestamps) before it is recorded without.
ABORT_REPORT_WAIT_S = 0.5
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Phase(enum.IntEnum):
    RECEIVED = 0  # reading, validating, tokenizing: no queue slot
    QUEUED = 1  # holds an admission slot; the engine has not answered yet
    GENERATING = 2  # the engine's first event came back; no response headers yet
    RESPONDING = 3  # the engine answered, the headers are out (they may leave sooner: ``Exchange.started``)
    ABANDONED = 4  # the client left before the last byte; waiting for the engine's word on where the request was
    CLOSED = 5  # the last byte handed over, or the exchange is over


def degraded_marker(tl: Timeline) -> str | None:
    """``system_fingerprint`` of a degraded answer (``tailguard-degraded:<mode>``): a typed field every OpenAI client
    exposes, so that a canned or truncated answer can be told from a full one without reading headers."""
    a = tl.slo_action
    if a is None or a.get("action") != "degrade":
        return None
    return f"tailguard-degraded:{a['mode']}"


def _degraded_headers(tl: Timeline) -> list[tuple[bytes, bytes]]:
    """``X-Tailguard-Degraded: template; tier=red; action=<id>`` on an answer the SLO monitor degraded."""
    a = tl.slo_action
    if a is None or a.get("action") != "degrade":
        return []
    return [(b"x-tailguard-degraded", f"{a['mode']}; tier={a['tier']}; action={a['action_id']}".encode())]


_UPSTREAM_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


# Room in a body for what is not the prompt (the other fields, the messages' JSON framing).
_BODY_OVERHEAD_BYTES = 64 * 1024


def _prompt_char_limit(engine: Backend) -> int | None:
    """The most characters a prompt that fits the context window can have (None: the backend does not tokenize)."""
    tok = engine.tokenizer
    if tok is None:
        return None
    return engine.max_model_len * tok.max_token_chars


def _prompt_chars(p: Parsed) -> int:
    if p.messages is not None:
        return sum(len(m["content"]) + len(m["role"]) for m in p.messages)
    return len(p.prompt or "")


# A prompt longer than this many characters a token of the context window is first tokenized in part: its head
# alone, cut at a space, shows most oversized prompts for what they are at a bounded cost.
_HEAD_CHARS_PER_TOKEN = 4


def _head_too_long(tok: Tokenizer, text: str, max_model_len: int) -> int | None:
    """The context window (to name in the error) when the head of ``text`` alone has more tokens than it; else None.

    Cut just before a space that precedes a word, the head's tokens are exactly the first tokens of the whole text
    (byte-level BPE never merges across that boundary), so a head over the limit proves the whole is over it. Text
    with no space near the cut (Chinese, a run of symbols) is not probed: the whole is tokenized."""
    probe = _HEAD_CHARS_PER_TOKEN * max_model_len
    if len(text) <= 2 * probe:
        return None
    cut = text.rfind(" ", probe // 2, probe)
    if cut <= 0 or text[cut + 1:cut + 2].isspace() or text[cut - 1].isspace():
        return None
    return max_model_len if len(tok.encode(text[:cut])) > max_model_len else None


def _prompt_text(p: Parsed) -> str:
    if p.messages is not None:
        return "\n".join(str(m.get("content") or "") for m in p.messages)
    return p.prompt or ""


class _Incoming:
    """What a completion handler reads of its HTTP request: the ASGI ``receive`` and the headers, decoded once into a
    dict (Starlette's ``Request.headers`` scans the raw list again at each lookup, and a request looks up a dozen)."""

    __slots__ = ("receive", "headers")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.receive = receive
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:  # lower-case names (ASGI); the first of repeated ones, as Starlette's
            key = name.decode("latin-1")
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers


def _forwarded(request: _Incoming) -> dict[str, str]:
    """Headers an upstream should see: the W3C trace context and the caller's session (never the API key)."""
    hdrs = request.headers
    return {k: v for k in ("traceparent", "tracestate") if (v := hdrs.get(k))}


def _clean_str(value: str | None, limit: int = 256) -> str | None:
    if not value:
        return None
    # Lone surrogates (legal in JSON escapes) cannot be stored as UTF-8: replace them.
    return value[:limit].encode("utf-8", "replace").decode("utf-8")


@dataclass
class Exchange:
    """One HTTP exchange: where it is (``phase``), how to answer (``send``) and its timeline."""

    state: ServerState
    send: Send
    tl: Timeline
    phase: Phase = Phase.RECEIVED
    gone_at: float | None = None  # when the client left, if it left before the last byte
    output: list[str] = field(default_factory=list)
    lane: LaneConfig | None = None  # the request's lane, when lanes are on
    tenant: str | None = None  # the API key's tenant (the SLO actions' tenant selectors), None without keys
    lane_slot: str | None = None  # the lane whose capacity slot this request holds (given back once, at the end)
    lane_tokens: int = 0  # the estimated tokens that slot holds (prompt + max_tokens)
    charged: tuple[Any, int, bool] | None = None  # (tenant, output tokens charged, charged in the shared store)
    audit_ids: list[int] | None = None  # the output token ids, kept when the speculation audit will rerun it
    relay: ClientRelay | None = None  # the gateway's direct relay of plain tokens, when the request has one
    started: bool = False  # the status and headers are out: the status cannot change any more

    def move(self, to: Phase) -> None:
        """Go forward to ``to``. Leaving QUEUED gives the queue slot back: here and nowhere else."""
        if to < self.phase:
            return  # phases only go forward (an error after the response ended changes nothing)
        if self.phase is Phase.QUEUED and to is not Phase.QUEUED:
            self.state.admission.leave()
        self.phase = to

    def enqueue(self) -> None:
        adm = self.state.admission
        if not adm.try_enter():
            wait = adm.retry_after()
            raise APIError(429, f"the server's waiting queue is full ({adm.capacity} requests); retry in {wait} s",
                           code="queue_full", headers={"Retry-After": str(wait)})
        self.move(Phase.QUEUED)

    def abandon(self) -> bool:
        """The client left. True if that was before the last byte (then the request is aborted)."""
        if self.phase >= Phase.ABANDONED:
            return False
        self.gone_at = perf_counter()
        self.move(Phase.ABANDONED)
        if self.relay is not None:
            self.relay.armed = False
            self.relay.opening = None
        return True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status and headers. Still waiting for the engine (an upstream's head, a keep-alive), the request
        stays QUEUED and keeps its slot until the engine's first event (``_take``)."""
        self.started = True
        if self.phase is not Phase.QUEUED:
            self.move(Phase.RESPONDING)
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [*headers, (b"x-request-id", self.tl.request_id.encode())]})

    async def chunk(self, body: bytes) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": True})

    async def last(self, body: bytes) -> None:
        self.move(Phase.CLOSED)  # before the send: a disconnect reported after the last byte is not an abort
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def fail(self, err: APIError) -> None:
        """Tell the client: an OpenAI error body, or, once a stream's status is out, an error event that ends it."""
        if self.phase is Phase.CLOSED:
            return
        with contextlib.suppress(Exception):  # the connection may be gone already
            if self.started:
                await self.last(sse_error(err.message, err.type, err.code))
                return
            body = err.body()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            await self.start(err.status, headers)
            await self.last(body)
        self.move(Phase.CLOSED)


# Starlette's disconnect listener (``StreamingResponse`` keeps it as a method that uses nothing of its response).
_listen_for_disconnect = partial(StreamingResponse.listen_for_disconnect, None)  # type: ignore[arg-type]


async def _watched(respond: Callable[[], Awaitable[None]], receive: Receive, on_disconnect: Callable[[], bool],
                   grace_s: float) -> None:
    """Run ``respond`` while a listener task waits for the client to go away, as ``StreamingResponse`` does. A client
    gone before the end first gets ``on_disconnect`` (abort in the engine) and ``grace_s`` for the engine's final
    event to say where the request was; then the response is cancelled. The response ending first cancels the
    listener. A failure of ``respond`` comes out as it is.

    Unlike ``StreamingResponse``, the response stays in this task and the listener is the child: a response in a
    child task would reach the engine one event-loop turn later (measured: +0.4 to 1 ms of queue hand-off at P50
    with 16 streams, benchmarks/server_overhead.py). Plain asyncio rather than an anyio task group: the group's
    cancel scope cost ~60 us a request on the gateway's path (its cancellation formats the task's repr).
    """
    me = asyncio.current_task()
    assert me is not None
    fired = False

    async def listen() -> None:
        nonlocal fired
        try:
            await _listen_for_disconnect(receive)
        except Exception:  # noqa: BLE001 - a server whose receive fails: no disconnect to wait for
            log.debug("the disconnect listener failed", exc_info=True)
            return
        if on_disconnect():
            await asyncio.sleep(grace_s)  # ended sooner by the response itself when the final event arrives
        fired = True
        me.cancel()  # the response is still running here: the listener is cancelled as soon as it ends

    listener = asyncio.get_running_loop().create_task(listen())
    try:
        await respond()
    except asyncio.CancelledError:
        if not fired or me.uncancel() > 0:  # cancelled from outside (shutdown), too
            raise
    else:
        if fired:  # the response swallowed the listener's cancellation: it is ours, not the caller's
            me.uncancel()
    finally:
        listener.cancel()


class _FallbackRecord:
    """What a stall fallback did, in the record (the answer is marked degraded, mode ``fallback``; the gateway
    section's ``fallback`` says from which replica, after how many tokens, to which, and how it ended) and metrics."""

    def __init__(self, tl: Timeline, gm: Any) -> None:
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


@dataclass
class _Prepared:
    """A validated, tokenized request, ready for the engine."""

    parsed: Parsed
    ids: list[int]
    text: str | None  # the prompt as text, when it came as text
    sampling: SamplingParams
    degradation: Degradation | None
    body: dict[str, Any]  # the request as the client sent it (forwarded to an upstream)


class CompletionEndpoint:
    def __init__(self, state: ServerState, chat: bool) -> None:
        self.state = state
        self.chat = chat
        self.endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        self._seq = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = perf_counter()
        st = self.state
        request = _Incoming(scope, receive)
        tl = self._timeline(request, received)
        ex = Exchange(st, send, tl)
        st.admission.in_flight += 1
        me = asyncio.current_task()
        st.admission.live[me] = ex  # what a drain on SIGTERM answers, waits for or ends (serving/drain.py)
        shutting_down = False
        try:
            await self._exchange(ex, request)
        except APIError as err:
            tl.error = _clean_str(err.message, 1000)
            await ex.fail(err)
            tl.finalize(err.status, err.outcome)
        except ClientDisconnect:  # gone while we read its body
            answered = scope.get("tailguard.answered")  # or cut by the connection guard (a 408 for a slow body)
            if answered is not None:
                tl.error = "the request body arrived too slowly"
                tl.finalize(answered, Outcome.INVALID)
            else:
                tl.error = tl.error or "client disconnected"
                tl.finalize(499, Outcome.ABORTED)
        except UpstreamError as exc:
            tl.error = _clean_str(exc.message, 1000)
            gm = st.gateway_metrics
            if gm is not None and ex.started:
                gm.interrupted.labels(gm.model, tl.lane).inc()
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
            # An upstream's own 4xx reaches the client as the upstream wrote it, and is the client's (invalid, or
            # rejected for a 429), never an error of the service's in the SLO.
            err = APIError(exc.status, exc.client_message or f"{exc.message}; request id {tl.request_id}",
                           type=exc.type, param=exc.param, code=exc.code, headers=headers)
            await ex.fail(err)
            tl.finalize(exc.status, err.outcome if exc.status < 500 else Outcome.ERROR)
        except SequenceFailed as exc:  # this request alone failed inside the engine; the engine goes on
            tl.error = _clean_str(str(exc), 1000)
            await ex.fail(APIError(500, f"the engine failed on this request ({exc}); request id {tl.request_id}",
                                   code="engine_request_failed"))
            tl.finalize(500, Outcome.ERROR)
        except EngineClosed as exc:  # the engine stopped under this request: say so, as a 503 the client may retry
            tl.error = _clean_str(str(exc), 1000)
            await ex.fail(APIError(503, f"the engine is not running ({exc}); request id {tl.request_id}",
                                   code="engine_unavailable", headers={"Retry-After": "5"}))
            tl.finalize(503, Outcome.ERROR)
        except asyncio.CancelledError:
            drain = st.admission.drain
            cut = drain.cut_error() if drain is not None else None
            if cut is None:
                tl.error = "cancelled by the server (shutdown)"
                tl.finalize(503, Outcome.ABORTED)
                shutting_down = True
                raise
            err, outcome = cut  # the drain ended it: the client gets its answer, the record says the same
            tl.error = err.message
            try:
                await ex.fail(err)
            finally:
                tl.finalize(err.status, outcome)
        except Exception:
            log.exception("request %s failed", tl.request_id)
            tl.error = "internal error"
            await ex.fail(APIError(500, f"internal server error; request id {tl.request_id}"))
            tl.finalize(500, Outcome.ERROR)
        finally:
            st.admission.live.pop(me, None)
            ex.move(Phase.CLOSED)  # gives the queue slot back if the request still held one
            if ex.lane_slot is not None and st.lanes is not None:
                st.lanes.release(ex.lane_slot, ex.lane_tokens)
                ex.lane_slot = None
            if ex.charged is not None:  # output tokens charged but never produced go back to the tenant
                tenant, max_out, shared = ex.charged
                st.shared.refund(tenant, max_out - tl.num_output_tokens, shared)
            if shutting_down:
                try:
                    st.close_record(tl)
                finally:
                    # Last, so that "nothing in flight" means every record has reached the store's queue.
                    st.admission.in_flight -= 1
            else:
                st.close_record_soon(tl)  # and in_flight with it, after the work this turn made ready

    def _timeline(self, request: _Incoming, received: float) -> Timeline:
        st, hdrs = self.state, request.headers
        tl = Timeline(request_id=request_id_from(hdrs.get("x-request-id")), endpoint=self.endpoint,
                      received=received, model=st.model_label)
        tl.business_type = st.metrics.business_type(hdrs.get("x-business-type")) if st.metrics else "default"
        tl.user = _clean_str(hdrs.get("x-user-id"))
        # A lane comes from the caller's API key (``_lane``), never from a header, unless the operator says the
        # header is set by a trusted proxy in front.
        tl.lane = clean_label(hdrs.get("x-lane")) if st.config.trust_lane_header else "default"
        tl.client = clean_label(hdrs.get("x-client"))
        tl.region = clean_label(hdrs.get("x-region"))
        return tl

    # --- the exchange -------------------------------------------------------------------------------------------------
    async def _exchange(self, ex: Exchange, request: _Incoming) -> None:
        st, tl = self.state, ex.tl
        caller = st.keys.client(request.headers.get("authorization"))
        tl.owner = caller.key_id
        ex.tenant = caller.tenant.name if caller.tenant is not None else None
        self._lane(ex, request, caller)
        engine = st.engine
        if st.admission.drain is not None:  # SIGTERM: the server drains (serving/drain.py); new work goes elsewhere
            raise st.admission.drain.refusal()
        if engine is None or not st.ready:
            msg = f"the model failed to load: {st.load_error}" if st.load_error else "the model is still loading"
            raise APIError(503, msg, code="model_not_ready", headers={"Retry-After": "5"})
        body = await self._read_body(request, self._body_limit(engine))
        # The SLO actions match the business type the client sent, not its metric label: the label set is capped
        # (an allowlist, or the first 32 types seen), and a type counted as "other" must still be shed or degraded.
        btype = clean_label(request.headers.get("x-business-type"))
        if ex.lane is None or ex.lane.sheddable:
            self._shed(tl, btype, ex.tenant)
        prep = await self._prepare(ex, engine, body, btype)
        if prep.degradation is not None and prep.degradation.mode == "template":
            await self._template(ex, prep.parsed, prep.degradation.template)
            return
        if caller.tenant is not None:
            shared = await self._charge(tl, caller.tenant, prep)
            ex.charged = (caller.tenant, prep.sampling.max_tokens, shared)
        if ex.lane is not None:
            await self._admit(ex, tl.num_prompt_tokens + prep.sampling.max_tokens)
        ex.enqueue()
        if st.batch_cap is not None:  # the forecast counts the load the engine is offered, when it arrived
            st.batch_cap.record_arrival(tl.received)
        tl.resources = st.resources()
        p, ids = prep.parsed, prep.ids
        if st.config.store_text:
            tl.prompt_text = prep.text if prep.text is not None else engine.tokenizer.decode(ids)
            tl.prompt_token_ids = ids
            if p.logprobs is not None:
                tl.logprobs = []
        engine_id = tl.request_id
        if engine_id in st.active_ids:  # a client reused its X-Request-ID while the first is still running
            self._seq += 1
            engine_id = f"{engine_id}#{self._seq}"
        st.active_ids.add(engine_id)
        tl.queued = perf_counter()
        priority = self._priority(ex, p.priority)
        lane = ex.lane
        takes_text = getattr(engine, "takes_text", False)
        opening = None
        affinity: str | None = None
        forwarded: dict[str, str] = {}
        if takes_text:
            affinity = engine.pool.affinity_key(p.user or request.headers.get("x-session-id"),  # type: ignore
                                                prep.text or "")
            forwarded = _forwarded(request)
            open_now = getattr(engine, "open", None)
            if open_now is not None:
                # The request leaves for a replica now; what reads its answer is built while the replica works.
                opening = open_now(prep.body, self.chat, engine_id, priority=priority, affinity_key=affinity,
                                   headers=forwarded)
        try:
            if takes_text and p.stream and self._relays(lane, p):
                ex.relay = ClientRelay.for_send(ex.send, st.relay_flusher)
            guard: Callable[[AsyncIterator[Any]], AsyncIterator[Any]] | None = None
            if lane is not None and lane.watches:
                guard = partial(watch, ttft_deadline=lane.ttft_deadline_s, itl_deadline=lane.itl_deadline_s,
                                misses=lane.stall_misses, keepalive=lane.keepalive_s if p.stream else None,
                                on_miss=self._on_miss(tl), relay=ex.relay)
            if takes_text:
                up = UpstreamRequest(
                    prep.body, self.chat, engine_id, p.max_tokens or 1, priority=priority,
                    est_tokens=tl.num_prompt_tokens + (p.max_tokens or 0), affinity_key=affinity, headers=forwarded,
                    relay=ex.relay, opening=opening)
                if guard is not None and lane is not None and lane.stall_fallback == "replica" and \
                        (lane.ttft_deadline_s or lane.itl_deadline_s):
                    # A stall continues the answer on another replica (the template only when that fails too).
                    agen = stall_fallback(engine, up, guard, _FallbackRecord(tl, self.state.gateway_metrics),  # type: ignore
                                          wanted=lambda: ex.phase < Phase.ABANDONED)
                    guard = None
                else:
                    agen = up.send(engine)  # type: ignore[arg-type]
            else:
                agen = engine.generate(ids, prep.sampling, engine_id, priority=priority, arrival_time=tl.received)
            if guard is not None:
                agen = guard(agen)
            respond = self._stream if p.stream else self._full

            def on_disconnect() -> bool:
                if not ex.abandon():
                    return False  # the answer was complete: uvicorn reports every closed connection
                engine.abort(engine_id)
                return True

            async with aclosing(agen):  # leaving early (error, disconnect) aborts the request in the engine
                try:
                    await _watched(lambda: respond(ex, p, agen), request.receive, on_disconnect, ABORT_REPORT_WAIT_S)
                except OSError:  # an ASGI 2.4 server may report a gone client as a failed send
                    if not on_disconnect():
                        raise
        except RequestError as exc:
            raise APIError(400, str(exc)) from None
        finally:
            st.active_ids.discard(engine_id)
            if opening is not None:
                opening.abandon()  # nothing, once the attempt took it up
        if ex.phase is Phase.ABANDONED:  # the engine said nothing in time: where it was is what we saw
            self._abandoned(ex, None)
        elif ex.audit_ids is not None and tl.spec_proposed and tl.outcome is Outcome.SUCCESS and not tl.degraded:
            assert st.audit is not None
            st.audit.submit(engine, tl.request_id, ids, prep.sampling, ex.audit_ids)

    def _relays(self, lane: LaneConfig | None, p: Parsed) -> bool:
        """Whether plain tokens may take the direct relay: not when something holds or rewrites each token after
        the first (pacing, flushing every N, logprobs). The stall watch counts the relay's tokens (its
        ``on_token``) and a stall fallback continues from its texts (``sink``); after the first token no loop turn
        passes between their generators and the stream (no task of their own), which keeps the relay's order."""
        return self.state.config.direct_relay and p.logprobs is None and (
            lane is None or (not lane.pace_itl_s and lane.flush_every <= 1))

    # --- lanes, tenants, stalls -----------------------------------------------------------------------------------
    def _lane(self, ex: Exchange, request: _Incoming, caller: Any) -> None:
        """The request's lane: its tenant's, else the default lane. A claimed lane header is ignored and recorded."""
        st, tl = self.state, ex.tl
        if st.lanes is None:
            return
        claimed = request.headers.get("x-lane")
        if caller.tenant is not None:
            name = caller.tenant.lane
            tl.gateway = {"tenant": caller.tenant.name}
        elif st.config.trust_lane_header and claimed and clean_label(claimed) in st.lanes.lanes:
            name = clean_label(claimed)
        else:
            name = st.config.default_lane
        if name not in st.lanes.lanes:
            raise APIError(500, f"this key's tenant is in lane {name!r}, which is not configured",
                           code="lane_not_configured")
        if claimed and not st.config.trust_lane_header and clean_label(claimed) != name:
            tl.gateway = {**(tl.gateway or {}), "lane_header_ignored": _clean_str(claimed, 64)}
            gm = st.gateway_metrics
            if gm is not None:
                gm.lane_claims_ignored.labels(gm.model).inc()
        tl.lane = name
        ex.lane = st.lanes.lanes[name].cfg

    def _priority(self, ex: Exchange, claimed: int | None) -> int:
        """The engine priority: the body's ``priority`` from a trusted proxy (a gateway in front sends its lane's),
        else the lane's (0 without lanes). A claim from anyone else is ignored and recorded."""
        own = ex.lane.priority if ex.lane is not None else 0
        if claimed is None or claimed == own:
            return own
        if self.state.config.trust_lane_header:
            return claimed
        ex.tl.gateway = {**(ex.tl.gateway or {}), "priority_ignored": claimed}
        return own

    async def _charge(self, tl: Timeline, tenant: Any, prep: _Prepared) -> bool:
        """Charge the tenant's rate limits (this gateway's, or the fleet's in Redis); True if charged in Redis."""
        try:
            return await self.state.shared.charge(tenant, tl.num_prompt_tokens + prep.sampling.max_tokens)
        except RateLimited as exc:
            gm = self.state.gateway_metrics
            if gm is not None:
                gm.rate_limited.labels(gm.model, tenant.name).inc()
            raise APIError(429, f"{exc.what}; retry in {exc.retry_after} s", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(exc.retry_after)}) from None

    async def _admit(self, ex: Exchange, tokens: int = 0) -> None:
        st, tl = self.state, ex.tl
        assert st.lanes is not None
        gm = st.gateway_metrics
        tenant = ex.tenant or ""
        try:
            waited = await st.lanes.acquire(tl.lane, tenant, tokens=tokens)
        except Overloaded as exc:
            if gm is not None:
                gm.lane_refused.labels(gm.model, tl.lane).inc()
            raise APIError(429, f"{exc}; retry in {exc.retry_after} s", type="rate_limit_error",
                           code="lane_overloaded", headers={"Retry-After": str(exc.retry_after)}) from None
        ex.lane_slot, ex.lane_tokens = tl.lane, tokens
        tl.gateway = {**(tl.gateway or {}), "lane_wait": round(waited, 6), "lane_tokens": tokens}
        if gm is not None:
            gm.child(gm.lane_wait, tl.lane).observe(waited)

    def _on_miss(self, tl: Timeline) -> Callable[[str], None]:
        gm = self.state.gateway_metrics

        def miss(kind: str) -> None:
            g = tl.gateway = tl.gateway or {}
            g[f"{kind}_misses"] = g.get(f"{kind}_misses", 0) + 1
            if gm is not None:
                gm.stalls.labels(gm.model, tl.lane, kind).inc()
        return miss

    def _stalled(self, ex: Exchange, exc: Stalled) -> str:
        """Mark the answer degraded after a stall; returns the text that ends it."""
        tl = ex.tl
        assert ex.lane is not None
        tl.slo_action = {"action": "degrade", "mode": "stall", "tier": "stream", "scope": f"lane:{tl.lane}",
                         "action_id": "stall", "reason": str(exc)}
        gm = self.state.gateway_metrics
        if gm is not None:
            gm.degraded.labels(gm.model, tl.lane).inc()
        return ex.lane.degrade_text

    def _abandoned(self, ex: Exchange, final: TokenEvent | None) -> None:
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

    def _body_limit(self, engine: Backend) -> int:
        """The most bytes a body may have: the configured limit, and below it the most a prompt that fits the
        context window can take as JSON (every character as a 12-byte surrogate-pair escape), so that an oversized
        body is refused from its Content-Length, before it is read, parsed or tokenized."""
        limit = self.state.config.max_body_bytes
        chars = _prompt_char_limit(engine)
        return limit if chars is None else min(limit, chars * 12 + _BODY_OVERHEAD_BYTES)

    async def _read_body(self, request: _Incoming, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        chunks, size = [], 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
            chunks.append(part)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _shed(self, tl: Timeline, btype: str, tenant: str | None) -> None:
        mon = self.state.slo
        # Selected by business type, lane and the API key's tenant (never a header's).
        shed = mon.shed_for(btype, tl.lane, tenant) if mon is not None else None
        if shed is None:
            return
        # Orange: non-core traffic is refused before it costs a parse, a tokenize or a queue slot.
        tl.slo_action = {k: shed[k] for k in ("action", "tier", "scope", "action_id")}
        wait = max(1, math.ceil(shed["retry_after_s"]))
        raise APIError(shed["status"], f"the service is shedding non-core traffic (SLO tier {shed['tier']}, "
                                       f"business type {btype!r}, lane {tl.lane!r}"
                                       f"{f', tenant {tenant!r}' if tenant else ''}); retry in {wait} s",
                       code="slo_shed", headers={"Retry-After": str(wait)})

    async def _prepare(self, ex: Exchange, engine: Backend, body: bytes, btype: str) -> _Prepared:
        st, tl = self.state, ex.tl
        data = decode_json(body)
        vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 1 << 31  # an upstream checks its own
        p = parse_chat(data) if self.chat else parse_completion(data, vocab)
        tl.stream = p.stream
        if p.model not in st.model_names:
            raise APIError(404, f"The model `{_clean_str(p.model, 200)}` does not exist; this server has: "
                                f"{', '.join(st.model_names)}", param="model", code="model_not_found")
        tl.user = _clean_str(p.user) or tl.user
        takes_text = getattr(engine, "takes_text", False)
        if takes_text:
            # The upstream tokenizes: the prompt's size is estimated (4 characters a token) for admission and
            # routing, and replaced by the upstream's own count when its usage comes back.
            if p.logprobs is not None:
                raise APIError(400, "logprobs are not available through the gateway yet", param="logprobs")
            ids, text = [], _prompt_text(p)
            tl.num_prompt_tokens = max(1, len(text) // 4)
        else:
            self._check_prompt_size(engine, p)
            ids, text = await self._tokenize(engine, p)
            tl.num_prompt_tokens = len(ids)
        tl.tokenized = perf_counter()
        requested = p.max_tokens
        if requested is None:
            requested = st.config.default_max_tokens or (
                256 if takes_text else max(1, engine.max_model_len - len(ids)))
        max_tokens = requested
        mon = st.slo
        # Never for a lane the monitor may not touch (``sheddable: false``, VIP by default) or a protected tenant.
        exempt = ex.lane is not None and not ex.lane.sheddable
        deg = mon.degradation_for(btype, tl.lane, tl.client, tl.region, len(ids), ex.tenant) \
            if mon and not exempt else None
        if deg is not None:
            tl.slo_action = {"action": "degrade", "mode": deg.mode, "tier": deg.tier, "scope": deg.scope,
                             "action_id": deg.action_id, "reason": deg.reason}
            if deg.mode == "truncate":
                max_tokens = min(requested, deg.max_tokens)
                tl.slo_action.update(max_tokens=max_tokens, requested_max_tokens=requested)
        p.max_tokens = max_tokens
        tl.sampling = p.sampling_record()
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
            stop=p.stop, ignore_eos=p.ignore_eos, min_tokens=min(p.min_tokens, max_tokens), logprobs=p.logprobs,
            speculative=p.speculative,
        )
        if takes_text:
            data = dict(data)
            data.pop("speculative", None)  # tailguard's own extension: not for the upstream
            if deg is not None and deg.mode == "truncate":
                data.pop("max_completion_tokens", None)
                data["max_tokens"] = max_tokens
            return _Prepared(p, ids, text, sampling, deg, data)
        if st.audit is not None and st.audit.wants(sampling):
            ex.audit_ids = []
        try:
            engine.check_request(len(ids), sampling)
        except RequestError as exc:
            msg = str(exc)
            long = "context" in msg or "KV" in msg or "empty" in msg
            raise APIError(400, msg, param=("messages" if self.chat else "prompt") if long else None,
                           code="context_length_exceeded" if "context" in msg else "invalid_value") from None
        return _Prepared(p, ids, text, sampling, deg, data)

    def _check_prompt_size(self, engine: Backend, p: Parsed) -> None:
        """Refuse a prompt too long for the context window by its characters alone, before it costs a tokenize."""
        limit = _prompt_char_limit(engine)
        size = _prompt_chars(p)
        where = "messages" if self.chat else "prompt"
        if limit is not None and size > limit:
            raise APIError(400, f"the prompt has {size:,} characters: more than the {engine.max_model_len:,}-token "
                                f"context window can hold (at most {limit:,} characters at "
                                f"{limit // engine.max_model_len} characters a token)",
                           param=where, code="context_length_exceeded")
        tok = engine.tokenizer
        if tok is None or size <= self.state.config.tokenize_in_thread_chars:
            return  # short: tokenizing it costs less than looking
        text = "".join(m["content"] for m in p.messages) if p.messages is not None else (p.prompt or "")
        floor = tok.min_tokens(text)
        if floor >= engine.max_model_len:
            raise APIError(400, f"the prompt has at least {floor:,} tokens; this model's context window is "
                                f"{engine.max_model_len:,} tokens", param=where, code="context_length_exceeded")

    async def _tokenize(self, engine: Backend, p: Parsed) -> tuple[list[int], str | None]:
        tok = engine.tokenizer

        def run() -> tuple[list[int], str | None]:
            if p.prompt_token_ids is not None:
                return p.prompt_token_ids, None
            if p.messages is None:
                text = p.prompt or ""
            else:
                text = render_chat_prompt(tok, p.messages, p.add_generation_prompt, p.continue_final_message)
            too_long = _head_too_long(tok, text, engine.max_model_len)
            if too_long is not None:
                raise APIError(400, f"the prompt has more than {too_long:,} tokens in its first "
                                    f"{_HEAD_CHARS_PER_TOKEN * engine.max_model_len:,} characters alone; this "
                                    f"model's context window is {engine.max_model_len:,} tokens",
                               param="messages" if self.chat else "prompt", code="context_length_exceeded")
            return tok.encode(text), text

        try:
            if _prompt_chars(p) > self.state.config.tokenize_in_thread_chars:
                # Off the event loop (the tokenizer lets go of the GIL for long texts), one long prompt at a time:
                # however many huge prompts arrive, they queue for one core and leave the rest to everybody else.
                async with self.state.long_tokenize:
                    return await asyncio.to_thread(run)
            return run()
        except APIError:
            raise
        except UnicodeEncodeError as exc:  # a lone surrogate: a legal JSON escape, but not Unicode text
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()[:40]
            raise APIError(400, f"the prompt is not valid Unicode text: it holds the lone surrogate {bad}",
                           param="messages" if self.chat else "prompt") from None
        except Exception as exc:  # noqa: BLE001 - whatever the template or tokenizer rejects is the input's fault
            raise APIError(400, f"the prompt could not be tokenized: {type(exc).__name__}: {str(exc)[:200]}",
                           param="messages" if self.chat else "prompt") from None

    # --- the engine's events ------------------------------------------------------------------------------------------
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
        reason = ev.finish_reason.value if hasattr(ev.finish_reason, "value") else str(ev.finish_reason)
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
            if reason in _UPSTREAM_REASONS:
                tl.finish_reason = reason
                return reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"the engine ended the request with finish reason {reason!r}")
        tl.finish_reason = reason
        return reason

    @staticmethod
    def _usage(tl: Timeline) -> dict[str, Any]:
        """What was really produced: the engine's count (a template answer counts none)."""
        usage: dict[str, Any] = {"prompt_tokens": tl.num_prompt_tokens, "completion_tokens": tl.num_output_tokens,
                                 "total_tokens": tl.num_prompt_tokens + tl.num_output_tokens}
        if tl.cached_prompt_tokens:  # as OpenAI and vLLM report prefix cache hits
            usage["prompt_tokens_details"] = {"cached_tokens": tl.cached_prompt_tokens}
        return usage

    @staticmethod
    def _extra(tl: Timeline) -> dict[str, Any]:
        """The top-level fields of the last chunk or of the body: the ``tailguard`` object (stage times, and
        ``degraded`` for an answer the SLO monitor changed) and, when degraded, a marked ``system_fingerprint``."""
        marker = degraded_marker(tl)
        return {"tailguard": tl.stage_object(), **({"system_fingerprint": marker} if marker else {})}

    def _logprobs(self, items: list, offset: int = 0) -> dict | None:
        tt = self.state.token_text
        assert tt is not None
        if self.chat:
            return chat_logprobs(tt, items)
        return completion_logprobs(tt, items, offset)

    async def _stream(self, ex: Exchange, p: Parsed, events: AsyncIterator[TokenEvent]) -> None:
        tl = ex.tl
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        keep_text = self.state.config.store_text
        lane = ex.lane
        # Pacing (L6): after the first token, a chunk leaves when the lane's inter-token budget has passed since the
        # last one or ``flush_every`` tokens are waiting; the tokens in between go together.
        pace = lane.pace_itl_s if lane is not None and not want_lp else None
        flush_every = lane.flush_every if lane is not None and not want_lp else 1
        pending = 0  # tokens produced but not yet sent (a token may carry no visible text yet)
        held: list[str] = []  # text held back by pacing
        last_sent = 0.0
        lp_items: list = []
        offset = 0
        final = None
        stalled: str | None = None
        role_sent = False

        async def start() -> None:
            if not ex.started:
                await ex.start(200, _SSE_HEADERS + _degraded_headers(tl))

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

        relay = ex.relay
        if relay is not None:
            relay.bind(tl, fmt.content, ex.output if keep_text else None)
        it = events.__aiter__()
        try:
            while True:
                if relay is not None:
                    # Armed only while waiting here, so that a token relayed directly never overtakes one this
                    # loop holds (the wait in a paused send included), and only after the first token went out.
                    relay.armed = role_sent and ex.phase is Phase.RESPONDING
                    # The first token may be written from the read, the status being out and nothing else sent.
                    relay.opening = opening if not role_sent and ex.started and ex.phase is Phase.QUEUED else None
                try:
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
                        self._abandoned(ex, ev)
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
                if not text:
                    continue
                if keep_text:
                    ex.output.append(text)
                if want_lp:
                    chunk = fmt.content_logprobs(text, self._logprobs(lp_items, offset))
                    offset += len(text)
                    lp_items = []
                else:
                    if (pace is not None or flush_every > 1) and last_sent:
                        held.append(text)
                        if pending < flush_every and (pace is None or perf_counter() - last_sent < pace):
                            continue
                        text = "".join(held)
                        held.clear()
                    chunk = fmt.content(text)
                if not role_sent and relay is not None and relay.first_sent is not None:
                    # Written from the upstream's read already, with the role chunk: the rest of what it means.
                    role_sent = True
                    count_stream()
                    last_sent = relay.first_sent
                    tl.add_tokens_sent(pending, last_sent)
                    pending = 0
                    g = tl.gateway = tl.gateway or {}
                    g["first_token_direct"] = True
                    continue
                if not role_sent or not ex.started:
                    chunk = await begin() + chunk
                await ex.chunk(chunk)
                last_sent = perf_counter()
                tl.add_tokens_sent(pending, last_sent)
                pending = 0
        except Stalled as exc:
            stalled = self._stalled(ex, exc)
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
        if p.include_usage:
            body = fmt.finish(last_text, reason, lp) + fmt.usage(self._usage(tl), **self._extra(tl))
        else:
            body = fmt.finish(last_text, reason, lp, **self._extra(tl))
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

    async def _full(self, ex: Exchange, p: Parsed, events: AsyncIterator[TokenEvent]) -> None:
        tl = ex.tl
        fmt = self._format(tl, p)
        want_lp = p.logprobs is not None
        texts: list[str] = []
        lp_items: list = []
        final = None
        stalled: str | None = None
        try:
            async for ev in events:
                if ev is KEEPALIVE or getattr(ev, "accepted", False):
                    continue
                if ex.phase is Phase.ABANDONED:
                    if ev.finished:
                        self._abandoned(ex, ev)
                        return
                    continue
                self._take(ex, ev, lp_items if want_lp else None)
                if ev.text:
                    texts.append(ev.text)
                if ev.finished:
                    final = ev
                    break
        except Stalled as exc:
            stalled = self._stalled(ex, exc)
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
        lp = self._logprobs(lp_items) if want_lp else None
        obj = fmt.full(text, reason, self._usage(tl), lp, **self._extra(tl))
        body = json.dumps(obj, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"server-timing", tl.server_timing().encode()), *_degraded_headers(tl)]
        await ex.start(200, headers)
        await ex.last(body)
        tl.finalize(200, Outcome.SUCCESS)

    async def _template(self, ex: Exchange, p: Parsed, text: str) -> None:
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
            await ex.start(200, _SSE_HEADERS + _degraded_headers(tl))
            tail = fmt.finish("", "stop", None, **self._extra(tl)) if not p.include_usage else (
                fmt.finish("", "stop", None) + fmt.usage(self._usage(tl), **self._extra(tl)))
            await ex.last(fmt.role(system_fingerprint=marker) + fmt.content(text) + tail + DONE)
        else:
            obj = fmt.full(text, "stop", self._usage(tl), None, **self._extra(tl))
            body = json.dumps(obj, ensure_ascii=False).encode()
            await ex.start(200, [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode()), *_degraded_headers(tl)])
            await ex.last(body)
        tl.finalize(200, Outcome.SUCCESS)
