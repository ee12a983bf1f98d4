"""The gateway's HTTP/1.1 client for the upstream streams: keep-alive connections per replica, opened before they
are needed.

A request that needs a new connection pays for it in its TTFT: the connect's round trip and, on the gateway's busy
event loop, the connection's setup in Python. A general client (aiohttp, which still does the health checks and the
``/metrics`` scrapes) opens a connection when a request finds none idle, so at every new high of the concurrency (and
after every lull longer than the idle timeout) the requests of that moment pay it, and they are the tail. Here, as
Envoy's preconnect does, each replica's pool keeps spare connections open ahead of demand (``spare`` plus
``spare_ratio`` of those in use), opened in the background when a request takes one.

Measured against aiohttp for the streams (benchmarks/gateway_overhead.py and gateway_request_cpu.py, docs/gateway.md
"What relaying costs"): at 256 streams ~50 connects fell inside a round's 35 timed seconds with aiohttp (2-3% of its
requests); the gateway's CPU fell 17% a request and 12-17% a token, its added median TTFT by 0.3-0.4 ms.

Idle connections are reused first in, first out, so that each is used often enough not to meet the upstream's
keep-alive timeout (uvicorn's 5 s: vLLM's, SGLang's, tailguard's); one idle longer than ``keepalive_s`` is closed, not
reused, and the spares are renewed by ``sweep``. A request whose reused connection fails before any byte of an answer
came back (the upstream closed it as the request went out: it never saw the request) is sent once more on a new
connection.

The response is parsed by ``httptools`` (llhttp, uvicorn's parser) in the protocol's callbacks; its body is read as
whatever arrived since the last read, one wake-up per read, as the gateway's SSE reader wants it, or handed as it
arrives to a ``tap`` (a callable set by the reader), which takes it inside the read callback, with no wake-up: the
gateway's direct relay of plain tokens (``backends/upstream/relay.py``).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from urllib.parse import unquote, urlsplit

import httptools

HIGH_WATER = 1 << 20  # body bytes waiting for the reader (or the tap's) before the socket stops being read
# The largest answer head taken from an upstream (the server's own limit for a client's head is 64 KiB): a replica
# that sends headers without end fails its request instead of growing the gateway.
MAX_HEAD_BYTES = 256 * 1024
DRAIN_TIMEOUT_S = 1.0  # the longest an answer's unread end is waited for before its connection is closed instead


class UpstreamProtocolError(ConnectionError):
    """The upstream's answer is not HTTP/1.1 we can read, or the connection broke before the answer ended."""


class ConnectFailed(ConnectionError):
    """No connection to the upstream could be opened (refused, unreachable, timed out): it never saw the request."""


class Connection(asyncio.Protocol):
    """One connection to an upstream and the answer of the request on it."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.in_request = False  # between its acquisition for a request and its release
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.framed = False  # the body's end is marked (a length or chunks), not the connection's close
        self.received = False  # any byte of an answer came back
        self._head_bytes = 0  # bytes read before the answer's head was complete
        self.exc: BaseException | None = None
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future | None = None
        # Takes each piece of the body as it arrives, instead of ``read``; True when it left something for the
        # reader, which is then woken (a piece the tap used up wakes nobody).
        self.tap: Callable[[bytes], bool] | None = None
        self._news = False

    # --- asyncio.Protocol -------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()  # kept: the lookup costs a getpid() call at each wait

    def data_received(self, data: bytes) -> None:
        if not self.in_request:  # bytes on an idle connection answer nothing we sent: not to be read as an answer
            self.close()
            return
        self.received = True
        self._news = self.tap is None  # with a tap, the reader is woken only for what it must see
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"the upstream's answer is not valid HTTP/1.1: {exc}"))
            self.close()
        if not self.headers_done and self.exc is None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError(f"the upstream's answer head is larger than {MAX_HEAD_BYTES:,} bytes"))
                self.close()
        if self._news or self.complete or self.exc is not None or not self.headers_done:
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.headers_done and not self.framed:
                self.complete = True  # a body that ends where the connection does
            else:
                self._fail(exc or UpstreamProtocolError("the upstream closed the connection before its answer ended"))
        self.pool._lost(self)
        self._wake()
        self.parser = None  # type: ignore[assignment]  # it refers back to this protocol: no cycle for the collector

    # --- httptools callbacks ----------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.framed = "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "")
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.tap is not None:
            if self.tap(body):
                self._news = True
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True

    # --- the request's side ------------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.exc is None:
            self.exc = exc

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = fut = self._loop.create_future()
        await fut

    def set_tap(self, tap: Callable[[bytes], bool] | None) -> None:
        """Give the body to ``tap`` from now on (what arrived with the head is given to it at once); None: back to
        ``read``."""
        self.tap = tap
        if tap is not None and self._body:
            data = b"".join(self._body)
            self._body.clear()
            self._buffered = 0
            if self._paused:
                self.pause_reading(False)
            tap(data)

    async def wait(self) -> None:
        """Until something happens on the connection: bytes (to ``read`` or given to the tap), the body's end, a
        failure."""
        if self.exc is not None:
            raise self.exc
        if not self.complete:
            await self._wait()

    def pause_reading(self, paused: bool) -> None:
        """Stop (or start again) reading the socket: the tap's taker is behind."""
        if paused != self._paused and self.transport is not None and not self.closed:
            self._paused = paused
            if paused:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def send(self, data: bytes) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise UpstreamProtocolError("the upstream closed the connection")
        self.transport.write(data)

    async def head(self) -> None:
        """Wait for the answer's status line and headers."""
        while not self.headers_done:
            if self.exc is not None:
                raise self.exc
            await self._wait()

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" at the body's end."""
        while True:
            body = self._body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.exc is not None:
                raise self.exc
            await self._wait()

    async def read_all(self, limit: int = 1 << 16) -> bytes:
        """The rest of the body, up to ``limit`` bytes (an error answer's)."""
        out = bytearray()
        while len(out) < limit:
            data = await self.read()
            if not data:
                break
            out += data
        return bytes(out[:limit])

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and not self._body and self.exc is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()  # connection_lost follows: the upstream sees the request abandoned
        self.closed = True


class Sent:
    """A request already written on an idle connection (``ConnectionPool.send_now``), for ``request`` to wait for its
    answer; ``abandon`` closes the connection if nothing ever does (the upstream sees the request abandoned)."""

    __slots__ = ("pool", "conn", "data", "at", "taken")

    def __init__(self, pool: ConnectionPool, conn: Connection, data: bytes) -> None:
        self.pool, self.conn, self.data = pool, conn, data
        self.at = time.perf_counter()
        self.taken = False

    def abandon(self) -> None:
        if not self.taken:
            self.taken = True
            self.pool._release(self.conn, False)


class ConnectionPool:
    """A replica's connections: idle ones reused first in, first out, spares opened ahead of need."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0, keepalive_s: float = 4.0, spare: int = 2,
                 spare_ratio: float = 0.1, ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"an upstream url must be http:// or https:// with a host, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":  # verified against the system's CAs, as aiohttp's default is
            self.ssl = ssl_context or ssl.create_default_context()
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self.base_path = parts.path.rstrip("/")  # an upstream behind a path prefix: requests' paths go under it
        self.basic_auth: str | None = None  # credentials in the url (http://user:pass@host), as aiohttp sent them
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.basic_auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.spare = spare
        self.spare_ratio = spare_ratio
        self.idle: deque[Connection] = deque()
        self.in_use = 0
        self.opening = 0
        self.opened = 0  # connections opened, in all
        self.opened_on_demand = 0  # ... of which a request waited for (no idle one was there)
        self.reconnects = 0  # requests sent again because a reused connection had been closed under them
        self.sent_ahead = 0  # requests written by ``send_now``, before their reader was built
        self.closed = False
        self._preconnect_failed = False  # the last background connect failed: no more until a request's works
        self._tasks: set[asyncio.Task] = set()

    async def _open(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(self), self.host, self.port, ssl=self.ssl,
                                                       server_hostname=self.host if self.ssl else None)
        except OSError as exc:  # TimeoutError included: told apart from a failure after the request was written
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        self.opened += 1
        return conn

    def _take_idle(self) -> Connection | None:
        now = time.monotonic()
        idle = self.idle
        while idle:
            conn = idle.popleft()
            if conn.closed:
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn.close()  # the upstream may be closing it right now: not worth the race
                continue
            return conn
        return None

    async def _acquire(self, fresh: bool = False) -> tuple[Connection, bool]:
        conn = None if fresh else self._take_idle()
        reused = conn is not None
        self.in_use += 1
        try:
            if conn is None:
                conn = await self._open()
                self.opened_on_demand += 1
                self._preconnect_failed = False
        except BaseException:
            self.in_use -= 1
            raise
        conn.in_request = True
        self._top_up()
        return conn, reused

    def _release(self, conn: Connection, reuse: bool) -> None:
        self.in_use -= 1
        conn.in_request = False
        if reuse and conn.reusable and not self.closed:
            conn._reset()
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    def _lost(self, conn: Connection) -> None:
        if conn in self.idle:  # closed by the upstream while idle (its keep-alive timeout, a restart)
            self.idle.remove(conn)

    def spares_wanted(self) -> int:
        return self.spare + int(self.in_use * self.spare_ratio)

    def _top_up(self) -> None:
        if self.closed or self._preconnect_failed:
            return
        for _ in range(self.spares_wanted() - len(self.idle) - self.opening):
            self.opening += 1
            task = asyncio.get_running_loop().create_task(self._preconnect())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _preconnect(self) -> None:
        try:
            conn = await self._open()
        except OSError:  # TimeoutError included
            self._preconnect_failed = True  # an unreachable replica: the requests' own connects report it
            return
        finally:
            self.opening -= 1
        if self.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def sweep(self) -> None:
        """Close the idle connections older than ``keepalive_s`` and open spares in their place (called
        periodically, so that a lull does not leave the next request only stale connections)."""
        now = time.monotonic()
        for conn in [c for c in self.idle if now - c.idle_since > self.keepalive_s]:
            self.idle.remove(conn)
            conn.close()
        self._top_up()

    def _request_bytes(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [f"{method} {self.base_path}{path} HTTP/1.1", f"Host: {self.authority}", f"Content-Length: {len(body)}"]
        if self.basic_auth is not None and not any(k.lower() == "authorization" for k in headers):
            lines.append(f"Authorization: {self.basic_auth}")
        for k, v in headers.items():
            if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
                raise ValueError(f"a line break in the header {k!r}")
            lines.append(f"{k}: {v}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def send_now(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> Sent | None:
        """Write a request at once on an idle connection, before the caller has built what reads its answer (which
        ``request(..., sent=)`` then does); None, and nothing sent, when no idle connection is at hand."""
        conn = None if self.closed else self._take_idle()
        if conn is None:
            return None
        data = self._request_bytes(method, path, body, headers)
        self.in_use += 1
        conn.in_request = True
        self._top_up()
        try:
            conn.send(data)
        except OSError:  # closed under us: the caller sends it the usual way
            self._release(conn, False)
            return None
        self.sent_ahead += 1
        return Sent(self, conn, data)

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes, headers: dict[str, str], sent: Sent | None = None
                      ) -> AsyncIterator[Connection]:
        """Send a request (``path`` under the url's own path); yields the connection once the answer's head has arrived (``status``, ``headers``,
        then ``read()``). Leaving by an exception closes the connection (the upstream sees the request abandoned);
        leaving normally pools it, once the rest of the answer, if any, has been read (in the background).
        ``sent``: the request, written already by ``send_now`` (``method``, ``path``, ``body`` and ``headers`` unused)."""
        conn: Connection | None
        if sent is not None:
            sent.taken = True
            conn, reused, data, written = sent.conn, True, sent.data, True
        else:
            data = self._request_bytes(method, path, body, headers)
            conn, reused = await self._acquire()
            written = False
        done = False
        try:
            while True:
                try:
                    if not written:
                        conn.send(data)
                    written = False
                    await conn.head()
                    break
                except OSError:  # UpstreamProtocolError included
                    if not reused or conn.received:
                        raise
                # The upstream had closed the idle connection: it never saw the request; once more on a new one.
                self._release(conn, False)
                conn = None
                self.reconnects += 1
                conn, reused = await self._acquire(fresh=True)
            yield conn
            done = True
        finally:
            if conn is not None:
                if done and not conn.complete and not conn.closed and conn.exc is None:
                    self._drain_later(conn)
                else:
                    self._release(conn, done)

    def _drain_later(self, conn: Connection) -> None:
        """Read the rest of an answer the caller is done with (the chunked body's end, sent after the last event in
        a write of its own by vLLM's server and any aiohttp or Starlette stream) in the background, then pool the
        connection: closing it would cost the next request a connect, waiting for it would delay the caller."""
        async def drain() -> None:
            try:
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    while await conn.read():
                        pass
            except OSError:
                pass  # timed out, or broke: not reusable, closed below
            finally:
                self._release(conn, True)

        task = asyncio.get_running_loop().create_task(drain())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        self.closed = True
        for task in list(self._tasks):
            task.cancel()
        while self.idle:
            self.idle.popleft().close()
