"""Connection hygiene: uvicorn's httptools protocol with the limits it lacks, for ``tailguard serve``.

uvicorn has a keep-alive timeout and ``limit_concurrency`` (a plain-text 503 that counts running tasks as well as
connections), and nothing else: httptools (llhttp) enforces no header size (a 67 MB head was answered 200, the parser
concatenating it in memory), and there is no timeout between a connection's first byte and the end of its request, so
a client that trickles its head or body is never cut, and one that connects and sends nothing is never closed.

``GuardedHttpToolsProtocol`` adds them, counted where uvicorn receives the bytes (``data_received``), so that neither
httptools nor uvicorn holds more than one read beyond a limit:

- **Head size** (``max_header_bytes``): a request head (request line and headers) larger than this is answered 431
  and the connection closed.
- **Head timeout** (``header_timeout_s``): a new connection must complete its first request's head within this time,
  a kept-alive one its next head within this time of its first byte; else 408 (closed silently if nothing came).
- **Body timeout** (``body_timeout_s`` plus 1 s per ``body_min_rate`` bytes received, mod_reqtimeout's rule): a body
  trickled slower is cut with a 408.
- **Idle keep-alive** (``keepalive_timeout_s``): uvicorn's own timer.
- **Connection cap** (``max_connections``): at the cap a new connection first evicts the connection idle longest
  (kept alive between requests, or still sending a head: neither has cost the server anything yet, nginx's rule for
  reusable connections); when every connection is busy with a request, the newcomer's request is answered 503 with a
  JSON body and ``Retry-After``, except the probes (``/health``, ``/ready``: a cheap answer, and a liveness probe that
  failed under load would get a busy but healthy server restarted). Past ``max_connections + overflow`` a connection
  is closed at once: the file descriptors stay under the process's limit, which is what broke ``/health`` before.

While the server drains (SIGTERM, serving/drain.py) every response carries ``connection: close``.

Deadlines are checked by one sweep for all connections, not a timer each, and only a read that ends inside a head or
a body adds one. What the guard adds (benchmarks/connection_guard.py --micro, CPU time): ~2 us per request on a
kept-alive connection, ~7 us per new connection, over the protocol's own ~18 and ~26 us.
"""

from __future__ import annotations

import asyncio
import logging
import re
import resource
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tailguard.api_error import error_body

if TYPE_CHECKING:
    from tailguard.serving.config import ServerConfig

log = logging.getLogger("tailguard.server")

OVER_CAP_RETRY_AFTER_S = 2  # the connection cap is a momentary state: try again soon
_base = HttpToolsProtocol  # its methods called directly: a zero-argument super() costs on every call
PROBES = frozenset({b"/health", b"/ready"})  # answered even over the connection cap
FD_RESERVE = 256  # file descriptors kept for everything but client connections (store, logs, upstream pools' extra)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 4096
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    body_min_rate: float = 16 * 1024  # bytes/s

    @classmethod
    def from_config(cls, config: ServerConfig, max_connections: int | None = None) -> ConnectionLimits:
        return cls(max_connections=max_connections or config.max_connections,
                   max_header_bytes=config.max_header_bytes, header_timeout_s=config.header_timeout_s,
                   body_timeout_s=config.body_timeout_s, body_min_rate=float(config.body_min_rate))


def overflow_of(cap: int) -> int:
    """Connections past the cap that still get their 503 (beyond them: closed at once)."""
    return max(16, cap // 16)


def connection_cap(config: ServerConfig, raise_limit: bool = False) -> int:
    """``max_connections``, lowered to what the open-file limit holds (an upstream stream needs a second descriptor).

    ``raise_limit`` (``tailguard serve``'s own process): first raise the soft limit towards the hard one, as far as the
    cap needs."""
    per = 2 if config.upstreams else 1
    want = config.max_connections
    need = (want + overflow_of(want)) * per + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return want
    if raise_limit and (hard == resource.RLIM_INFINITY or hard > soft):
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # pragma: no cover - a sandbox may refuse: keep the soft limit
            pass
        if soft >= need:
            return want
    budget = max(2, (soft - FD_RESERVE) // per) if soft > FD_RESERVE else max(2, soft // (2 * per))
    cap = max(1, budget - overflow_of(budget))
    log.warning("max_connections %d does not fit the open-file limit (%d): capped at %d connections", want, soft, cap)
    return cap


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = error_body(message, "invalid_request_error", None, code)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def _refusal_app(status: int, message: str, type_: str, code: str, retry_after: int | None = None) -> Any:
    """An ASGI app that answers every request with one OpenAI-style error and closes the connection."""
    body = error_body(message, type_, None, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return refuse


class ConnectionGuard:
    """What one server's connections share: how many are open, which may be evicted, whether the server drains."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.overflow = overflow_of(limits.max_connections)
        self.open = 0
        self.idle: dict[GuardedHttpToolsProtocol, None] = {}  # evictable, the longest idle first
        self.draining = False
        # Connections reading a head or a body, and when they are due: one sweep checks them all, a few times per
        # timeout (rather than a timer, and its cancellation, for every new connection and every slow read).
        self.deadlines: dict[GuardedHttpToolsProtocol, float] = {}
        self.tick = max(0.05, min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4))
        self._sweeping: asyncio.TimerHandle | None = None
        # bad_request, head_too_large, head_timeout, body_timeout, evicted, over_cap, dropped
        self.counts: Counter[str] = Counter()
        lim = limits
        self.bad_request = _raw_response(
            400, "Bad Request", "the request is not valid HTTP/1.1 (its framing: the request line, a header, "
                                "Content-Length or Transfer-Encoding, a chunk size)", "invalid_http_request")
        self.head_too_large = _raw_response(
            431, "Request Header Fields Too Large", f"the request head is larger than {lim.max_header_bytes} bytes",
            "request_header_fields_too_large")
        self.head_timeout = _raw_response(
            408, "Request Timeout", f"the request head did not arrive within {lim.header_timeout_s:g} s",
            "request_timeout")
        self.body_timeout = _raw_response(
            408, "Request Timeout", f"the request body arrived too slowly (it gets {lim.body_timeout_s:g} s plus 1 s "
                                    f"per {lim.body_min_rate:g} bytes)", "request_timeout")
        self.refuse_head = _refusal_app(431, f"the request head is larger than {lim.max_header_bytes} bytes",
                                        "invalid_request_error", "request_header_fields_too_large")
        self.refuse_over_cap = _refusal_app(
            503, f"the server has too many connections open ({lim.max_connections}); retry in "
                 f"{OVER_CAP_RETRY_AFTER_S} s", "service_unavailable", "too_many_connections", OVER_CAP_RETRY_AFTER_S)

    def watch(self, conn: GuardedHttpToolsProtocol, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        self.deadlines[conn] = deadline
        if self._sweeping is None:
            self._sweeping = loop.call_later(self.tick, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for conn in [c for c, due in self.deadlines.items() if due <= now]:
            try:
                conn._due(now)
            except Exception:  # noqa: BLE001 - one connection's failure must not stop the sweep for the others
                log.exception("connection sweep")
                self.deadlines.pop(conn, None)
        self._sweeping = loop.call_later(self.tick, self._sweep, loop) if self.deadlines else None

    def protocol_class(self) -> type[GuardedHttpToolsProtocol]:
        """The protocol class uvicorn instantiates per connection, bound to this guard."""
        return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"guard": self})

    def begin_drain(self, connections: Any) -> None:
        """The server drains: every response from now on closes its connection."""
        self.draining = True
        for conn in list(connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False


# An ``Upgrade`` header line of a request head (its value up to the line's end).
_UPGRADE_LINE = re.compile(rb"\r\n[Uu][Pp][Gg][Rr][Aa][Dd][Ee][ \t]*:([^\r\n]*)")


def ignore_unsupported_upgrade(data: bytes) -> bytes:
    """A request that offers to switch to a protocol the server does not speak (``Upgrade: h2c`` from curl --http2
    or Java's HttpClient) is served as the HTTP/1.1 request it also is (RFC 9110: a server may ignore an Upgrade).
    The HTTP parser would take the bytes after its head as the new protocol's: the body lost, or read as a request
    of its own. So the header is renamed in the head that begins this read (a head split across reads is left as
    it is); a WebSocket upgrade is left alone."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return data
    m = _UPGRADE_LINE.search(data, 0, end + 2)
    if m is None or b"websocket" in m.group(1).lower():
        return data
    return data[:m.start()] + b"\r\nX-Ignored-Upgrade:" + data[m.start(1):]


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    guard: ConnectionGuard  # set on the subclass ``ConnectionGuard.protocol_class`` makes
    # Per-connection state, as class defaults: a connection that never changes one costs no assignment.
    _counted = False  # in ``guard.open``
    _over_cap = False  # arrived over the cap: its request is refused (probes excepted), then it closes
    _in_head = True  # the next bytes belong to a request head (none received yet, or part of one)
    _head_split = False  # a head may have begun inside the current read, after the previous message's end
    _done_headers: list[tuple[bytes, bytes]] | None = None  # the header list of the last complete message
    _head_bytes = 0
    _chunk_len = 0
    _body_pending = False  # between the end of a head and the end of its body
    _body_bytes = 0
    _body_start = 0.0
    url = b""  # uvicorn sets it at each message's start

    # --- the connection ---------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _base.connection_made(self, transport)
        g = self.guard
        cap = g.limits.max_connections
        if g.open >= cap:
            if g.idle:  # the longest idle makes room
                next(iter(g.idle))._evict()
            elif g.open >= cap + g.overflow:
                g.counts["dropped"] += 1
                transport.abort()
                return
            else:
                self._over_cap = True
        g.open += 1
        self._counted = True
        g.idle[self] = None
        # Its first head must be complete in time; a connection that sends nothing is closed at that deadline too.
        g.watch(self, self.loop.time() + g.limits.header_timeout_s, self.loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        _base.connection_lost(self, exc)

    def _release(self) -> None:
        g = self.guard
        g.deadlines.pop(self, None)
        if self._counted:
            self._counted = False
            g.open -= 1
            g.idle.pop(self, None)

    def _evict(self) -> None:
        self.guard.counts["evicted"] += 1
        self._release()
        self.transport.abort()  # nothing is owed to it: no request of its is being handled

    def _cut(self, response: bytes | None, what: str) -> None:
        """Answer (when nothing was sent for the request yet) and close."""
        self.guard.counts[what] += 1
        self.guard.deadlines.pop(self, None)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if response is not None and (cycle is None or cycle.response_complete or not cycle.response_started):
            if cycle is not None and not cycle.response_complete:
                cycle.response_started = True  # the app's own answer, if it comes, must not follow ours
                # What the client was told, for the request's record (the app sees only a disconnect).
                scope = cast("dict[str, Any]", cycle.scope)  # an extension key of our own (ASGI allows them)
                scope["tailguard.answered"] = int(response.split(b" ", 2)[1])
            self.transport.write(response)
        self.transport.close()

    def _due(self, now: float) -> None:
        """The sweep found this connection's deadline passed."""
        g = self.guard
        if self.transport.is_closing():
            g.deadlines.pop(self, None)
        elif self._in_head:
            if self._head_bytes:
                self._cut(g.head_timeout, "head_timeout")
            else:  # connected and sent nothing: closed, as an idle keep-alive connection is
                self._cut(None, "idle_timeout")
        elif self._body_pending:
            lim = g.limits
            if self.flow.read_paused:  # the app is not reading it yet: the wait is ours, not the client's
                self._body_start, self._body_bytes = now, 0
            allowed = self._body_start + lim.body_timeout_s + self._body_bytes / lim.body_min_rate
            if now < allowed:  # it kept the minimum rate so far
                g.deadlines[self] = allowed
            else:
                self._cut(g.body_timeout, "body_timeout")
        else:
            g.deadlines.pop(self, None)

    # --- reads ------------------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._in_head and b"pgrade" in data:
            data = ignore_unsupported_upgrade(data)
        if self._body_pending:
            self._body_bytes += len(data)
        self._head_split = False
        self._chunk_len = len(data)
        _base.data_received(self, data)
        if self._in_head:
            if self.transport.is_closing():
                return
            # The read ended inside a head: count it (a head that began mid-read counts what was parsed of it).
            if self._head_split:  # uvicorn gives each message a new header list: none yet, nothing parsed of it
                self._head_bytes = self._parsed_head_size() if self.headers is not self._done_headers else 0
            else:
                self._head_bytes += len(data)
            g = self.guard
            if self._head_bytes > g.limits.max_header_bytes:
                self._cut(g.head_too_large, "head_too_large")
            elif self._head_bytes and self not in g.deadlines:
                g.watch(self, self.loop.time() + g.limits.header_timeout_s, self.loop)
        elif self._body_pending:
            g = self.guard
            if self not in g.deadlines and not self.transport.is_closing():
                self._body_start = now = self.loop.time()
                g.watch(self, now + g.limits.body_timeout_s, self.loop)

    def send_400_response(self, msg: str) -> None:
        """Bytes the HTTP parser refuses: the API's JSON error (uvicorn's is plain text), counted, and closed."""
        self._cut(self.guard.bad_request, "bad_request")

    def _parsed_head_size(self) -> int:
        return len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers or ())

    # --- parser callbacks -------------------------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        g = self.guard
        self._in_head = False
        g.deadlines.pop(self, None)
        limit = g.limits.max_header_bytes
        # Exact only when the reads so far could hold a head over the limit (one that arrived in a single read).
        too_big = self._head_bytes + self._chunk_len > limit and self._parsed_head_size() > limit
        self._head_bytes = 0
        self._body_pending = True
        self._body_bytes = 0
        g.idle.pop(self, None)  # busy with a request: not evictable
        refusal = None
        if too_big:
            g.counts["head_too_large"] += 1
            refusal = g.refuse_head
        elif self._over_cap and httptools.parse_url(self.url).path not in PROBES:
            g.counts["over_cap"] += 1
            refusal = g.refuse_over_cap
        if refusal is None:
            _base.on_headers_complete(self)
        else:
            app, self.app = self.app, refusal
            try:
                _base.on_headers_complete(self)
            finally:
                self.app = app
        if self._over_cap or g.draining:
            cycle = self.cycle
            if cycle is not None:
                cycle.keep_alive = False

    def on_message_complete(self) -> None:
        _base.on_message_complete(self)
        self._done_headers = self.headers
        self._body_pending = False
        self._in_head = True
        self._head_split = True
        if self._body_bytes:  # the body took more than the head's read: it may be watched
            self.guard.deadlines.pop(self, None)

    def on_response_complete(self) -> None:
        _base.on_response_complete(self)
        cycle = self.cycle
        if self._counted and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.guard.idle[self] = None  # idle again: evictable, the most recently
