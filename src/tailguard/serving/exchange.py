"""One HTTP exchange of the completion endpoints: the request as read (``Incoming``), where the exchange is
(``Phase``), how it answers (``Exchange``: status and headers, chunks, the last byte, an error), and the watch for a
client that goes away while the answer is produced (``run_watched``).

An exchange moves through ``Phase`` in one direction: RECEIVED (read, validate, tokenize; no queue slot) -> QUEUED
(holds an admission slot, handed to the backend) -> GENERATING (the backend's first event came back) -> RESPONDING
(the backend answered and the response headers are out) -> CLOSED (the last byte handed over, or the exchange ended
any other way), or ABANDONED (the client left first). ``Exchange.move`` is the only place a queue slot is given back,
whatever ends the wait. The headers may leave before RESPONDING (``Exchange.started``): a stream's status and
headers go out when an upstream replica accepts the request (its 200 head, before its first token, as the replica
sent them) or with a keep-alive; the request keeps its queue slot until the backend's first event all the same.

While the answer is written, ``Exchange.net`` samples the client connection (``serving/network.py``: the kernel's
TCP_INFO and the write backpressure) at the first body write, at most every 100 ms of later writes and at the end
(the last write, the client leaving, or the exchange closing any other way); its summary is the record's ``network``.

A write that finds the transport's flow control paused (the client reads slower than the answer is written: the
socket's buffers and uvicorn's are full) waits in ``send`` until the client has read enough. That wait is the
client's, not the server's: it goes on the timeline (``Timeline.client_waited``), whose figures leave it out
(docs/metrics.md, "A slow reader's time is its own"). A write that does not wait costs one attribute read more.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tailguard.api_error import APIError
from tailguard.observe.metrics import clean_label
from tailguard.observe.timeline import Timeline
from tailguard.policy.decision import Decision, clean_text
from tailguard.serving.client_relay import ClientRelay
from tailguard.serving.ids import request_id_from
from tailguard.serving.network import NetworkSampler, cycle_of, region_map
from tailguard.serving.responses import sse_error
from tailguard.serving.state import ServerState

log = logging.getLogger("tailguard.server")
perf_counter = time.perf_counter

SSE_HEADERS = [
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


def degraded_headers(tl: Timeline) -> list[tuple[bytes, bytes]]:
    """``X-Tailguard-Degraded: template; tier=red; action=<id>`` on an answer the SLO monitor degraded."""
    a = tl.slo_action
    if a is None or a.get("action") != "degrade":
        return []
    return [(b"x-tailguard-degraded", f"{a['mode']}; tier={a['tier']}; action={a['action_id']}".encode())]


class Incoming:
    """What a completion handler reads of its HTTP request: the ASGI ``receive`` and the headers, decoded once into a
    dict (Starlette's ``Request.headers`` scans the raw list again at each lookup, and a request looks up a dozen)."""

    __slots__ = ("receive", "headers", "client")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.receive = receive
        self.client = scope.get("client")  # (host, port) of the peer, when the server knows it
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:  # lower-case names (ASGI); the first of repeated ones, as Starlette's
            key = name.decode("latin-1")
            if key not in headers:
                headers[key] = value.decode("latin-1")
        self.headers = headers


def forwarded_headers(request: Incoming) -> dict[str, str]:
    """Headers an upstream should see: the W3C trace context and the caller's session (never the API key)."""
    hdrs = request.headers
    return {k: v for k in ("traceparent", "tracestate") if (v := hdrs.get(k))}


@dataclass
class Exchange:
    """One HTTP exchange: where it is (``phase``), how to answer (``send``) and its timeline."""

    state: ServerState
    send: Send
    tl: Timeline
    phase: Phase = Phase.RECEIVED
    gone_at: float | None = None  # when the client left, if it left before the last byte
    output: list[str] = field(default_factory=list)
    decision: Decision = field(default_factory=Decision)  # the traffic policy's, and what the request holds
    audit_ids: list[int] | None = None  # the output token ids, kept when the speculation audit will rerun it
    output_ids: list[int] | None = None  # the output token ids, kept when they are sealed for a rebuild
    relay: ClientRelay | None = None  # the gateway's direct relay of plain tokens, when the request has one
    started: bool = False  # the status and headers are out: the status cannot change any more
    net: NetworkSampler | None = None  # the client connection's TCP state, sampled while the answer is written
    # uvicorn's flow control of the client connection (``write_paused``: a write would wait for the client); found
    # when the response starts, None under another server.
    flow: Any = None

    def move(self, to: Phase) -> None:
        """Go forward to ``to``. Leaving QUEUED gives the queue slot back: here and nowhere else."""
        if to < self.phase:
            return  # phases only go forward (an error after the response ended changes nothing)
        if self.phase is Phase.QUEUED and to is not Phase.QUEUED:
            self.state.admission.leave()
        self.phase = to
        if to is Phase.CLOSED and self.net is not None:  # however the exchange ended, before its record closes
            self._network_done()

    def _network_done(self) -> None:
        net, self.net = self.net, None
        if net is not None:
            self.tl.network = net.finish()

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
        self._network_done()
        return True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status and headers. Still waiting for the engine (an upstream's head, a keep-alive), the request
        stays QUEUED and keeps its slot until the engine's first event (``_take``)."""
        self.started = True
        if self.net is None and self.phase < Phase.ABANDONED and self.state.config.network_sampling:
            self.net = NetworkSampler.for_send(self.send)
        if self.flow is None:
            self.flow = self.net.flow if self.net is not None else getattr(cycle_of(self.send), "flow", None)
        if self.phase is not Phase.QUEUED:
            self.move(Phase.RESPONDING)
        message = {"type": "http.response.start", "status": status,
                   "headers": [*headers, (b"x-request-id", self.tl.request_id.encode())]}
        if self.flow is not None and self.flow.write_paused:  # a previous answer on the connection is still unread
            await self._held(message)
        else:
            await self.send(message)

    async def _held(self, message: dict[str, Any]) -> None:
        """``send`` while the client's flow control holds writes: it waits for the client to read, and the wait goes
        on the timeline as the client's time."""
        start = perf_counter()
        try:
            await self.send(message)
        finally:
            self.tl.client_waited(start, perf_counter())

    async def chunk(self, body: bytes) -> None:
        net, flow = self.net, self.flow
        message = {"type": "http.response.body", "body": body, "more_body": True}
        if net is None or body[:1] == b":":  # a keep-alive comment is no token: not sampled
            if flow is not None and flow.write_paused:
                await self._held(message)
            else:
                await self.send(message)
            return
        if flow is not None and flow.write_paused:
            net.waits += 1  # this write waits for the client to read
            await self._held(message)
        else:
            await self.send(message)
        net.on_write()

    async def last(self, body: bytes) -> None:
        net, self.net = self.net, None  # sampled after the last write, not when the phase closes just before it
        self.move(Phase.CLOSED)  # before the send: a disconnect reported after the last byte is not an abort
        flow = self.flow
        message = {"type": "http.response.body", "body": body, "more_body": False}
        try:
            if flow is not None and flow.write_paused:
                if net is not None:
                    net.waits += 1
                await self._held(message)
            else:
                await self.send(message)
        finally:
            if net is not None:
                self.net = net
                self._network_done()

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
listen_for_disconnect = partial(StreamingResponse.listen_for_disconnect, None)  # type: ignore[arg-type]


async def run_watched(respond: Callable[[], Awaitable[None]], receive: Receive, on_disconnect: Callable[[], bool],
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
            await listen_for_disconnect(receive)
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


def open_timeline(state: ServerState, request: Incoming, endpoint: str, received: float) -> Timeline:
    """A request's timeline from its headers: its id, user, client and region (its fingerprint; the business type
    comes once its caller is known, in ``identify``)."""
    hdrs = request.headers
    tl = Timeline(request_id=request_id_from(hdrs.get("x-request-id")), endpoint=endpoint, received=received,
                  model=state.model_label)
    tl.user = clean_text(hdrs.get("x-user-id"))
    # A lane comes from the caller's API key (``TrafficPolicy.choose_lane``), never from a header, unless the
    # operator says the header is set by a trusted proxy in front.
    tl.lane = clean_label(hdrs.get("x-lane")) if state.config.trust_lane_header else "default"
    tl.client = clean_label(hdrs.get("x-client"))
    # The configured region header, else the client's network in ``region_cidrs`` (serving/network.py).
    tl.region = region_map(state.config).region(hdrs, request.client)
    return tl


def identify(state: ServerState, ex: Exchange, request: Incoming) -> None:
    """Who is calling (the API key's owner and tenant) and in which lane, on the record and the decision; refused
    while the server drains."""
    caller = state.keys.client(request.headers.get("authorization"))
    ex.tl.owner = caller.key_id
    if state.metrics is not None:  # only once the key is good: a refused caller's made-up types take no label
        ex.tl.business_type = state.metrics.business_type(request.headers.get("x-business-type"))
    ex.decision.tenant = caller.tenant
    state.policy.choose_lane(ex.decision, ex.tl, request.headers.get("x-lane"))
    if state.admission.drain is not None:  # SIGTERM: the server drains (serving/drain.py); new work goes elsewhere
        raise state.admission.drain.refusal()
