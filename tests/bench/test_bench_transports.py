"""The bench's two HTTP clients read every kind of answer the same way: an event stream, a whole JSON body, an error
(whose body the bench reads only as far as its message), a stream cut short. Served by a raw asyncio server so the
answers can be as odd as a real endpoint's."""

from __future__ import annotations

import asyncio
import json

import pytest

from tailguard.bench.client import ERROR_BODY_BYTES, TRANSPORTS, Endpoint, RequestResult, make_transport, send

CHUNK = json.dumps({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]})
LAST = json.dumps({"choices": [{"delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2}})
WHOLE = json.dumps({"choices": [{"message": {"content": "hello there"}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def _head(status: int, ctype: str, chunked: bool = True, extra: str = "") -> bytes:
    framing = "Transfer-Encoding: chunked" if chunked else "Connection: close"
    return (f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\n{framing}\r\nx-request-id: srv-1\r\n"
            f"server-timing: queue;dur=5\r\n{extra}\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Scripted:
    """Answers each POST by its path's first part (/stream, /whole, /error, /endless-error, /cut); the path ends in
    /chat, so the bench reads chat answers."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            await getattr(self, path.strip("/").split("/")[0].replace("-", "_"))(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stream(self, w: asyncio.StreamWriter) -> None:
        w.write(_head(200, "text/event-stream"))
        for data in (CHUNK, CHUNK, LAST, "[DONE]"):
            w.write(_chunk(f"data: {data}\n\n".encode()))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()

    async def whole(self, w: asyncio.StreamWriter) -> None:
        body = WHOLE.encode()
        w.write(_head(200, "application/json", chunked=False, extra=f"Content-Length: {len(body)}\r\n") + body)
        await w.drain()

    async def error(self, w: asyncio.StreamWriter) -> None:
        body = json.dumps({"error": {"message": "the model is resting", "type": "server_error"}}).encode()
        w.write(_head(503, "application/json", chunked=False, extra=f"Content-Length: {len(body)}\r\n") + body)
        await w.drain()

    async def endless_error(self, w: asyncio.StreamWriter) -> None:
        # An error whose body never ends: the bench keeps its first bytes as the message and stops reading.
        w.write(_head(500, "text/plain"))
        piece = _chunk(b"E" * 65536)
        while self.sent_bytes < 256 << 20:
            w.write(piece)
            self.sent_bytes += len(piece)
            await w.drain()

    async def cut(self, w: asyncio.StreamWriter) -> None:
        w.write(_head(200, "text/event-stream"))
        w.write(_chunk(f"data: {CHUNK}\n\n".encode()) + b"0\r\n\r\n")
        await w.drain()


async def _send(transport_name: str, path: str, stream: bool) -> tuple[RequestResult, Scripted]:
    srv = Scripted()
    url = await srv.start()
    transport = make_transport(transport_name)
    await transport.start(4, 30.0)
    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
        res = RequestResult(0, "r0", None, 0.0)
        await send(transport, Endpoint(url, path=path + "/chat"), body, {"Content-Type": "application/json"}, res,
                   stream)
        return res, srv
    finally:
        await transport.close()
        srv.server.close()


@pytest.fixture(params=sorted(TRANSPORTS))
def transport_name(request) -> str:
    return request.param


def test_a_stream_is_read_chunk_by_chunk_with_the_servers_headers(transport_name):
    res, _ = asyncio.run(_send(transport_name, "/stream", stream=True))
    assert res.ok, res.error
    assert res.chunk_texts == ["hi", "hi"] and res.finish_reason == "stop"
    assert res.usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert res.server_request_id == "srv-1" and res.server_timing == {"queue": 0.005}
    assert res.sent <= res.headers_at <= res.first_token_at <= res.chunk_times[-1] <= res.end
    assert res.chunk_times[1] - res.chunk_times[0] > 0.005  # each chunk's own arrival time, not the stream's end


def test_a_whole_json_answer_is_one_chunk(transport_name):
    res, _ = asyncio.run(_send(transport_name, "/whole", stream=False))
    assert res.ok, res.error
    assert not res.streamed and res.chunk_texts == ["hello there"] and res.finish_reason == "length"


def test_an_error_keeps_the_servers_message(transport_name):
    res, _ = asyncio.run(_send(transport_name, "/error", stream=True))
    assert not res.ok and res.status == 503
    assert res.error == "HTTP 503: the model is resting"


def test_an_endless_error_body_is_read_only_as_far_as_its_message(transport_name):
    res, srv = asyncio.run(_send(transport_name, "/endless-error", stream=True))
    assert res.status == 500 and res.error.startswith("HTTP 500: EEEE") and len(res.error) < 400
    # The bench hung up after its first bytes; the server got no further than its socket buffers allow.
    assert srv.sent_bytes < 64 * ERROR_BODY_BYTES


def test_a_stream_cut_before_done_is_a_failed_request(transport_name):
    res, _ = asyncio.run(_send(transport_name, "/cut", stream=True))
    assert not res.ok and res.error == "stream ended without [DONE]" and res.chunk_texts == ["hi"]
