"""The bench's HTTP side: one request out, every streamed chunk timestamped as it arrives.

Two transports share one SSE parser: aiohttp (the default: in ``benchmarks/bench_capacity.py`` it drove about
three times the request rate of httpx from one core) and httpx (``--http-client httpx``). Each read from the socket is
timestamped with ``time.perf_counter()`` before it is parsed, so parsing cost never shifts a token's time; events
that arrive in one read share its timestamp (that is when the client had them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tailguard.usage import clean_usage

perf = time.perf_counter


class RequestResult:
    """Everything the client saw of one request (perf_counter seconds)."""

    __slots__ = (
        "index", "request_id", "server_request_id", "warmup", "spec", "intended", "sent", "headers_at",
        "first_token_at", "end", "chunk_times", "chunk_texts", "chunk_usage", "text", "status", "error",
        "finish_reason", "usage", "tailguard", "server_timing", "llama_timings", "record", "role_only_chunks", "streamed",
    )

    def __init__(self, index: int, request_id: str, spec: Any, intended: float, warmup: bool = False) -> None:
        self.index = index
        self.request_id = request_id
        self.server_request_id: str | None = None
        self.warmup = warmup
        self.spec = spec
        self.intended = intended
        self.sent = intended
        self.headers_at: float | None = None
        self.first_token_at: float | None = None
        self.end: float | None = None
        self.chunk_times: list[float] = []
        self.chunk_texts: list[str] = []
        self.chunk_usage: list[int | None] = []  # cumulative completion tokens per chunk (continuous usage stats)
        self.text = ""
        self.status = 0
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.tailguard: dict | None = None
        self.server_timing: dict[str, float] | None = None
        self.llama_timings: dict | None = None
        self.record: dict | None = None
        self.role_only_chunks = 0
        self.streamed = True  # False: a whole JSON answer (one "chunk", no per-token times at the client)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.end is not None


def parse_server_timing(value: str | None) -> dict[str, float] | None:
    """``name;dur=12.3, other;dur=4`` -> {name: seconds}."""
    if not value:
        return None
    out: dict[str, float] = {}
    for part in value.split(","):
        fields = [f.strip() for f in part.split(";")]
        if not fields[0]:
            continue
        for f in fields[1:]:
            if f.startswith("dur="):
                with contextlib.suppress(ValueError):
                    out[fields[0]] = float(f[4:]) / 1e3
    return out or None


# The most one answer may send before the bench stops reading it: its text and its chunks' times stay in memory until
# the report, so a server that streams without end fails that request, not the bench.
MAX_ANSWER_BYTES = 32 << 20
def too_long(res: RequestResult) -> None:
    res.error = res.error or f"the answer passed {MAX_ANSWER_BYTES >> 20} MiB; the bench stopped reading it"


class SSEParser:
    """Feeds raw bytes (with the time they arrived) and fills a RequestResult. Each read's bytes are scanned once
    (a line that never ends costs its length, not its square); ``feed`` returns False once the answer passed
    MAX_ANSWER_BYTES (the caller stops reading)."""

    __slots__ = ("res", "buf", "chat", "done", "seen")

    def __init__(self, res: RequestResult, chat: bool) -> None:
        self.res = res
        self.buf = bytearray()
        self.chat = chat
        self.done = False
        self.seen = 0

    def feed(self, data: bytes, t: float) -> bool:
        self.seen += len(data)
        if self.seen > MAX_ANSWER_BYTES:
            too_long(self.res)
            return False
        if self.buf:
            if b"\n" not in data:
                self.buf += data
                return True
            buf = bytes(self.buf) + data
        else:
            buf = data
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            if nl < 0:
                break
            line = buf[start:nl]
            start = nl + 1
            if line.startswith(b"data:"):
                self._event(line[5:].strip(), t)
        self.buf = bytearray(buf[start:])
        return True

    def _event(self, payload: bytes, t: float) -> None:
        res = self.res
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            res.error = res.error or f"unparsable SSE data: {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            res.error = res.error or f"SSE data that is not a JSON object: {payload[:80]!r}"
            return
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            res.error = str(err.get("message", err) if isinstance(err, dict) else err)
            return
        usage = clean_usage(obj.get("usage"))
        choices = obj.get("choices") or ()
        text = ""
        try:
            for ch in choices:
                if self.chat:
                    delta = ch.get("delta") or {}
                    parts = (delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning"))
                else:
                    parts = (ch.get("text"),)
                text += "".join(x for x in parts if isinstance(x, str))
                finish = ch.get("finish_reason")
                if finish:
                    res.finish_reason = str(finish)[:40]
        except AttributeError:  # choices, or a choice's delta, that are not objects
            res.error = res.error or f"a chunk of an unexpected shape: {payload[:80]!r}"
            return
        if text:
            if res.first_token_at is None:
                res.first_token_at = t
            res.chunk_times.append(t)
            res.chunk_texts.append(text)
            res.chunk_usage.append(usage.get("completion_tokens") if isinstance(usage, dict) else None)
        elif choices:
            res.role_only_chunks += 1
        if isinstance(usage, dict) and (not text or not choices):
            res.usage = usage
        elif isinstance(usage, dict):
            res.usage = usage  # continuous usage: the last one seen is the total
        tg = obj.get("tailguard")
        if isinstance(tg, dict):
            res.tailguard = tg
        timings = obj.get("timings")
        if isinstance(timings, dict):
            res.llama_timings = timings


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    path: str = "/v1/chat/completions"
    headers: dict[str, str] | None = None
    timeout: float = 600.0

    @property
    def chat(self) -> bool:
        return "chat" in self.path

    @property
    def full_url(self) -> str:
        return self.url.rstrip("/") + self.path


class _Transport:
    name = "?"

    async def start(self, max_connections: int, timeout: float) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def post(self, url: str, body: bytes, headers: dict[str, str], res: RequestResult, stream: bool,
                   chat: bool) -> None:
        raise NotImplementedError

    async def get_json(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        raise NotImplementedError


async def _read_capped(pieces: Any, res: RequestResult) -> bytes | None:
    """A whole answer's bytes, or None (and the request's error) once it passes MAX_ANSWER_BYTES."""
    out = bytearray()
    async for piece in pieces:
        out += piece
        if len(out) > MAX_ANSWER_BYTES:
            too_long(res)
            return None
    return bytes(out)


def _finish_nonstream(res: RequestResult, data: bytes, t: float, chat: bool) -> None:
    res.streamed = False
    try:
        obj = json.loads(data)
    except ValueError:
        res.error = "unparsable JSON response"
        return
    try:
        ch = (obj.get("choices") or [{}])[0]
        text = ((ch.get("message") or {}).get("content") or "") if chat else (ch.get("text") or "")
        res.finish_reason = ch.get("finish_reason")
    except (AttributeError, KeyError, IndexError, TypeError):
        res.error = "a JSON answer of an unexpected shape"
        return
    if not isinstance(text, str):
        res.error = "a JSON answer whose text is not a string"
        return
    res.usage = clean_usage(obj.get("usage"))
    if isinstance(obj.get("tailguard"), dict):
        res.tailguard = obj["tailguard"]
    if isinstance(obj.get("timings"), dict):
        res.llama_timings = obj["timings"]
    if text:
        res.first_token_at = t
        res.chunk_times.append(t)
        res.chunk_texts.append(text)
        res.chunk_usage.append((res.usage or {}).get("completion_tokens"))


# An error answer is read this far: its message is all the bench keeps (a hostile endpoint's endless error body
# must not fill the bench's memory).
ERROR_BODY_BYTES = 64 << 10


async def _head_of(pieces: AsyncIterator[bytes], limit: int) -> bytes:
    out = bytearray()
    async for piece in pieces:
        out += piece
        if len(out) >= limit:
            break
    return bytes(out[:limit])


async def _take_answer(res: RequestResult, status: int, headers: Any,
                       pieces: Callable[[bool], AsyncIterator[bytes]], stream: bool, chat: bool) -> None:
    """Read an answer whose head has come (either transport): an error's message, an event stream token by token,
    or a whole JSON body. ``pieces(sse)`` gives the body's chunks."""
    res.headers_at = perf()
    res.status = status
    res.server_request_id = headers.get("x-request-id")
    res.server_timing = parse_server_timing(headers.get("server-timing"))
    if status != 200:
        res.error = _error_text(status, await _head_of(pieces(False), ERROR_BODY_BYTES))
        res.end = perf()
        return
    if stream and headers.get("content-type", "").startswith("text/event-stream"):
        parser = SSEParser(res, chat)
        async for data in pieces(True):
            if not parser.feed(data, perf()):
                break
        res.end = perf()
        if not parser.done and res.error is None:
            res.error = "stream ended without [DONE]"
    else:
        data = await _read_capped(pieces(False), res)
        res.end = perf()
        if data is not None:
            _finish_nonstream(res, data, res.end, chat)


def _error_text(status: int, data: bytes) -> str:
    try:
        obj = json.loads(data)
        err = obj.get("error", obj)
        msg = err.get("message", err) if isinstance(err, dict) else err
        return f"HTTP {status}: {str(msg)[:300]}"
    except (ValueError, AttributeError):
        return f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}"


class AiohttpTransport(_Transport):
    name = "aiohttp"

    async def start(self, max_connections: int, timeout: float) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        conn = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=300,
                                    keepalive_timeout=60)
        self.session = aiohttp.ClientSession(
            connector=conn, timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 30)),
            auto_decompress=True, trust_env=False, read_bufsize=2**16,
        )

    async def close(self) -> None:
        await self.session.close()

    async def post(self, url, body, headers, res, stream, chat) -> None:
        res.sent = perf()
        async with self.session.post(url, data=body, headers=headers) as resp:
            await _take_answer(res, resp.status, resp.headers, lambda _sse: resp.content.iter_any(), stream, chat)

    async def get_json(self, url, headers=None):
        async with self.session.get(url, headers=headers) as resp:
            data = await resp.read()
            try:
                return resp.status, json.loads(data)
            except ValueError:
                return resp.status, None


class HttpxTransport(_Transport):
    name = "httpx"

    async def start(self, max_connections: int, timeout: float) -> None:
        import httpx

        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=min(timeout, 30)),
                                        trust_env=False)

    async def close(self) -> None:
        await self.client.aclose()

    async def post(self, url, body, headers, res, stream, chat) -> None:
        res.sent = perf()
        async with self.client.stream("POST", url, content=body, headers=headers) as resp:
            # An event stream's bytes as they came (no decoder in the way of each chunk's arrival time).
            await _take_answer(res, resp.status_code, resp.headers,
                               lambda sse: resp.aiter_raw() if sse else resp.aiter_bytes(), stream, chat)

    async def get_json(self, url, headers=None):
        resp = await self.client.get(url, headers=headers)
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, None


TRANSPORTS = {"aiohttp": AiohttpTransport, "httpx": HttpxTransport}


def make_transport(name: str = "aiohttp") -> _Transport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown HTTP client {name!r}; choose from {', '.join(TRANSPORTS)}")
    return TRANSPORTS[name]()


async def send(transport: _Transport, ep: Endpoint, body: bytes, headers: dict[str, str], res: RequestResult,
               stream: bool) -> RequestResult:
    """Send one request; never raises (failures land in ``res.error``)."""
    try:
        await transport.post(ep.full_url, body, headers, res, stream, ep.chat)
    except asyncio.CancelledError:
        res.error = res.error or "cancelled at the end of the run (drain timeout)"
        res.end = None
        raise
    except TimeoutError:
        res.error = f"timeout after {ep.timeout:g} s"
    except Exception as exc:  # connection refused, reset, protocol errors: all are request failures
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    if res.error and res.end is None:
        res.end = perf()
    return res
