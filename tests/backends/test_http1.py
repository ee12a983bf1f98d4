"""The gateway's upstream HTTP/1.1 client (backends/upstream/http1.py) against a scripted server on a real socket."""

from __future__ import annotations

import asyncio
import functools
import shutil
import ssl
import subprocess
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from tailguard.backends.upstream.http1 import ConnectFailed, ConnectionPool, UpstreamProtocolError


def sync(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())
    return run


Handler = Callable[[int, int, bytes, asyncio.StreamWriter], Awaitable[bool]]


class ScriptedServer:
    """Reads each request on each connection and hands (connection no., request no. on it, body, writer) to
    ``handler``, which answers and says whether the connection stays open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof_seen = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no, n = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                n += 1
                if not await self.handler(conn_no, n, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof_seen.set()
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


def answering(raw: bytes) -> Handler:
    """A handler that answers every request with ``raw`` and keeps the connection."""
    async def answer(_c: int, _n: int, _b: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(raw)
        return True
    return answer


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


async def stream_answer(_c: int, _n: int, body: bytes, w: asyncio.StreamWriter) -> bool:
    w.write(HEAD_CHUNKED + chunked(b"data: one\n\n"))
    await w.drain()
    await asyncio.sleep(0.02)
    w.write(chunked(b"data: two\n\n", b"data: " + body + b"\n\n") + b"0\r\n\r\n")
    await w.drain()
    return True


async def read_body(pool: ConnectionPool, body: bytes = b"x") -> tuple[int, list[bytes]]:
    async with pool.request("POST", "/v1/completions", body, {"Content-Type": "application/json"}) as resp:
        parts = []
        while data := await resp.read():
            parts.append(data)
        return resp.status, parts


async def read_sent(pool: ConnectionPool, body: bytes) -> tuple[int, bytes]:
    """A request written at once by ``send_now`` (there is an idle connection), its answer read by ``request``."""
    sent = pool.send_now("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    assert sent is not None
    async with pool.request("POST", "", b"", {}, sent=sent) as resp:
        parts = []
        while data := await resp.read():
            parts.append(data)
        return resp.status, b"".join(parts)


@sync
async def test_streams_a_chunked_body_and_reuses_the_connection() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        status, parts = await read_body(pool, b"first")
        assert status == 200
        assert parts[0] == b"data: one\n\n"  # the first piece came on its own, before the rest was sent
        assert b"".join(parts) == b"data: one\n\ndata: two\n\ndata: first\n\n"
        _, parts = await read_body(pool, b"second")
        assert b"".join(parts).endswith(b"data: second\n\n")
        assert srv.connections == 1 and pool.opened == 1 and len(pool.idle) == 1
        assert srv.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"Content-Length: 5\r\n" in srv.requests[0] and srv.requests[0].endswith(b"\r\n\r\nfirst")
        pool.close()


@sync
async def test_an_error_answer_and_its_headers() -> None:
    msg = b'{"error": {"message": "busy"}}'
    refuse = answering(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(msg), msg))
    async with ScriptedServer(refuse) as url:
        pool = ConnectionPool(url, spare=0)
        async with pool.request("POST", "/v1/completions", b"{}", {}) as resp:
            assert resp.status == 503 and resp.headers["retry-after"] == "7"
            assert await resp.read_all() == b'{"error": {"message": "busy"}}'
        assert len(pool.idle) == 1  # read to its end: pooled
        pool.close()


@sync
async def test_a_reused_connection_closed_under_the_request_is_retried_once_on_a_new_one() -> None:
    async def close_second(_c: int, n: int, body: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 2:
            return False  # closes without an answer, as a keep-alive timeout does when the request crosses it
        return await stream_answer(_c, n, body, w)

    for ahead in (False, True):  # sent by ``request``, or written ahead by ``send_now``
        srv = ScriptedServer(close_second)
        async with srv as url:
            pool = ConnectionPool(url, spare=0)
            await read_body(pool)
            if ahead:
                status, body = await read_sent(pool, b"again")
            else:
                status, parts = await read_body(pool, b"again")
                body = b"".join(parts)
            assert status == 200 and body.endswith(b"data: again\n\n")
            assert pool.reconnects == 1 and srv.connections == 2 and pool.in_use == 0
            pool.close()


@sync
async def test_a_request_written_ahead_is_answered_on_its_connection_and_an_unread_one_is_closed() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        assert pool.send_now("POST", "/v1/completions", b"x", {}) is None  # no idle connection: nothing written
        assert srv.requests == [] and pool.in_use == 0
        await read_body(pool, b"first")
        status, body = await read_sent(pool, b"ahead")
        assert status == 200 and body.endswith(b"data: ahead\n\n")
        assert srv.connections == 1 and pool.in_use == 0 and len(pool.idle) == 1
        assert srv.requests[1].startswith(b"POST /v1/completions HTTP/1.1\r\n") and srv.requests[1].endswith(b"ahead")
        # Written, then nothing took it up: abandoning it closes the connection (the upstream sees it abandoned).
        sent = pool.send_now("POST", "/v1/completions", b"orphan", {})
        assert sent is not None and pool.in_use == 1
        sent.abandon()
        sent.abandon()  # once only
        assert pool.in_use == 0 and not pool.idle and sent.conn.closed
        await asyncio.wait_for(srv.eof_seen.wait(), 5)
        pool.close()


@sync
async def test_a_new_connection_that_fails_is_not_retried() -> None:
    async def close_at_once(*_: object) -> bool:
        return False

    srv = ScriptedServer(close_at_once)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        with pytest.raises(UpstreamProtocolError):
            await read_body(pool)
        assert srv.connections == 1 and pool.reconnects == 0 and pool.in_use == 0


@sync
async def test_a_broken_stream_raises_and_an_abandoned_one_closes_the_connection() -> None:
    async def cut(_c: int, _n: int, _b: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(HEAD_CHUNKED + chunked(b"data: one\n\n"))
        await w.drain()
        await asyncio.sleep(0.05)
        return False  # no terminating chunk

    async with ScriptedServer(cut) as url:
        pool = ConnectionPool(url, spare=0)
        with pytest.raises(UpstreamProtocolError, match="before its answer ended"):
            await read_body(pool)

    async def slow(_c: int, _n: int, _b: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(HEAD_CHUNKED + chunked(b"data: one\n\n"))
        await w.drain()
        await asyncio.sleep(0.3)
        return True

    srv = ScriptedServer(slow)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        with pytest.raises(RuntimeError):
            async with pool.request("POST", "/", b"", {}) as resp:
                assert await resp.read() == b"data: one\n\n"
                raise RuntimeError("the client went away")
        assert pool.in_use == 0 and not pool.idle
        # Closed, not pooled: the upstream sees the request abandoned (its reader gets the end of the stream).
        assert resp.closed and resp.transport is not None and resp.transport.is_closing()
        await asyncio.wait_for(srv.eof_seen.wait(), 6)


@sync
async def test_garbage_is_a_protocol_error_and_an_unframed_body_ends_with_the_connection() -> None:
    async with ScriptedServer(answering(b"SPDY/9 what\r\n\r\n")) as url:
        pool = ConnectionPool(url, spare=0)
        with pytest.raises(UpstreamProtocolError, match="not valid HTTP"):
            await read_body(pool)

    async def until_close(_c: int, _n: int, _b: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\n")
        await w.drain()
        return False

    async with ScriptedServer(until_close) as url:
        pool = ConnectionPool(url, spare=0)
        status, parts = await read_body(pool)
        assert status == 200 and b"".join(parts) == b"data: a\n\n"
        assert not pool.idle  # not reusable


@sync
async def test_spares_are_opened_ahead_so_a_burst_does_not_wait_for_connects() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url, spare=3)
        await read_body(pool)  # the first request opens one; three spares follow in the background
        await asyncio.sleep(0.05)
        assert len(pool.idle) == 4 and pool.opened_on_demand == 1
        await asyncio.gather(*(read_body(pool) for _ in range(4)))
        assert pool.opened_on_demand == 1  # the four found connections waiting
        await asyncio.sleep(0.05)
        assert len(pool.idle) >= 4
        pool.close()
        assert not pool.idle


@sync
async def test_idle_connections_past_keepalive_are_not_reused_and_sweep_renews_spares() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url, spare=1, keepalive_s=0.1)
        await read_body(pool)
        await asyncio.sleep(0.05)
        assert len(pool.idle) == 2
        await asyncio.sleep(0.1)
        pool.sweep()  # both are past keep-alive: closed, and one spare opened in their place
        await asyncio.sleep(0.05)
        assert len(pool.idle) == 1 and srv.connections == 3
        await read_body(pool)
        assert pool.opened_on_demand == 1  # the renewed spare served it
        pool.close()


@sync
async def test_header_injection_is_refused() -> None:
    async with ScriptedServer(stream_answer) as url:
        pool = ConnectionPool(url, spare=0)
        with pytest.raises(ValueError, match="line break"):
            async with pool.request("POST", "/", b"", {"X-Request-ID": "a\r\nEvil: 1"}):
                pass
        assert pool.in_use == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for a test certificate")
def test_https_upstreams(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def main() -> None:
        srv = ScriptedServer(stream_answer)
        server = await asyncio.start_server(srv._serve, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            url = f"https://localhost:{port}"
            with pytest.raises(ConnectFailed) as refused:  # not a certificate the system trusts: no request sent
                await read_body(ConnectionPool(url, spare=0))
            assert isinstance(refused.value.__cause__, ssl.SSLCertVerificationError)
            pool = ConnectionPool(url, spare=0, ssl_context=ssl.create_default_context(cafile=str(cert)))
            status, parts = await read_body(pool, b"tls")
            assert status == 200 and b"".join(parts).endswith(b"data: tls\n\n")
            await read_body(pool)
            assert pool.opened == 1  # reused
            pool.close()
        finally:
            server.close()

    asyncio.run(main())


@sync
async def test_an_answer_left_before_its_end_is_drained_in_the_background_then_pooled() -> None:
    async def late_end(_c: int, _n: int, _b: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(HEAD_CHUNKED + chunked(b"data: [DONE]\n\n"))
        await w.drain()
        await asyncio.sleep(0.1)  # the body's end, in a write of its own
        w.write(b"0\r\n\r\n")
        return True

    srv = ScriptedServer(late_end)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with pool.request("POST", "/", b"", {}) as resp:
            assert await resp.read() == b"data: [DONE]\n\n"
        assert loop.time() - t0 < 0.08  # the caller did not wait for the end
        assert pool.in_use == 1 and not pool.idle  # ... the drain did
        await asyncio.sleep(0.2)
        assert pool.in_use == 0 and len(pool.idle) == 1
        await read_body(pool)
        assert srv.connections == 1
        pool.close()


@sync
async def test_bytes_on_an_idle_connection_close_it_and_are_never_read_as_an_answer() -> None:
    async def answer_twice(_c: int, n: int, body: bytes, w: asyncio.StreamWriter) -> bool:
        await stream_answer(_c, n, body, w)
        if n == 1:  # a stray second answer, nobody asked for
            await asyncio.sleep(0.02)
            w.write(b"HTTP/1.1 500 Stray\r\nContent-Length: 0\r\n\r\n")
        return True

    srv = ScriptedServer(answer_twice)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        await read_body(pool)
        await asyncio.sleep(0.1)
        assert not pool.idle  # closed when the stray bytes came
        status, parts = await read_body(pool, b"next")
        assert status == 200 and b"".join(parts).endswith(b"data: next\n\n") and srv.connections == 2
        pool.close()


def test_closed_connections_leave_no_garbage_cycles() -> None:
    """The server runs the cycle collector once a minute (serving/gc_schedule.py), counting on reference counting to
    free a request's objects: a closed connection must not leave a cycle (the parser refers back to its protocol)."""
    import gc

    import uvloop

    async def main() -> int:
        async with ScriptedServer(stream_answer) as url:
            pool = ConnectionPool(url, spare=0)
            for _ in range(3):  # warm: first-use caches
                await read_body(pool)
                pool.idle[0].close()
            await asyncio.sleep(0.05)
            gc.collect()
            gc.disable()
            try:
                for _ in range(20):
                    await read_body(pool)
                    pool.idle[0].close()
                await asyncio.sleep(0.05)
                return gc.collect()
            finally:
                gc.enable()

    assert uvloop.run(main()) == 0


@sync
async def test_an_upstream_url_with_a_path_prefix_keeps_it() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url + "/team-a/", spare=0)
        await read_body(pool)
        assert srv.requests[0].startswith(b"POST /team-a/v1/completions HTTP/1.1\r\n")
        pool.close()


@sync
async def test_credentials_in_the_url_are_sent_as_basic_auth_unless_a_key_is() -> None:
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url.replace("http://", "http://ann:p%40ss@"), spare=0)
        await read_body(pool)
        async with pool.request("POST", "/v1/completions", b"", {"Authorization": "Bearer k"}) as resp:
            await resp.read_all()
        assert b"\r\nAuthorization: Basic YW5uOnBAc3M=\r\n" in srv.requests[0]  # ann:p@ss
        assert b"Basic" not in srv.requests[1] and b"\r\nAuthorization: Bearer k\r\n" in srv.requests[1]
        assert b"ann" not in srv.requests[0].split(b"\r\n")[1]  # not in the Host header
        pool.close()


@sync
async def test_a_redirecting_upstream_is_a_failed_replica_not_a_redirect_for_the_client() -> None:
    from tailguard.backends.upstream.events import UpstreamError
    from tailguard.backends.upstream.pool import RoutingConfig, UpstreamConfig, UpstreamPool
    from tailguard.backends.upstream.proxy import UpstreamBackend

    redirect = answering(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://elsewhere/\r\nContent-Length: 0\r\n\r\n")
    async with ScriptedServer(redirect) as url:
        backend = UpstreamBackend(UpstreamPool([UpstreamConfig(url=url)], RoutingConfig(retries=0)))
        with pytest.raises(UpstreamError) as err:
            async for _ in backend.generate_request({"messages": [{"role": "user", "content": "hi"}]}, True, "r"):
                pass
        assert err.value.status == 502 and err.value.code == "upstream_error" and "answered 307" in err.value.message
        assert backend.pool.replicas[0].errors == 1
        backend.pool.replicas[0].conns.close()


@sync
async def test_a_tap_gets_the_body_as_it_arrives_and_wakes_the_reader_only_when_it_says_so() -> None:
    """What came with the head goes to the tap when it is set; a piece the tap used up wakes nobody; the end does."""
    srv = ScriptedServer(stream_answer)
    async with srv as url:
        pool = ConnectionPool(url, spare=0)
        async with pool.request("POST", "/v1/completions", b"tapped", {}) as resp:
            await asyncio.sleep(0.01)  # "data: one" is in by now, read with the head
            seen: list[bytes] = []
            resp.set_tap(lambda data: seen.append(data) or False)  # used up: no wake-up
            assert seen == [b"data: one\n\n"]
            woken = 0
            while not resp.complete:
                await resp.wait()
                woken += 1
            assert b"".join(seen) == b"data: one\n\ndata: two\n\ndata: tapped\n\n"
            assert woken == 1  # once, at the body's end: not for the pieces the tap took
            resp.set_tap(None)
            assert await resp.read() == b""
        assert len(pool.idle) == 1  # pooled as usual
        pool.close()
