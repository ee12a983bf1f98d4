"""A fast, scripted, OpenAI-compatible fake server: the bench's test target and its capacity yardstick.

It speaks HTTP/1.1 (keep-alive, pipelining, chunked SSE) over raw asyncio protocols (uvloop when present), with
``httptools`` parsing the requests, to be much faster than any real server, so that a bench run against it measures
the bench. Every timing is scripted: time to first token, inter-chunk gaps, uniform jitter, chunks that carry several
tokens, errors. Each response is paced against absolute deadlines from the moment the request was parsed, so waits do not accumulate drift, and the server
records when each chunk was actually handed to the socket (``time.perf_counter()``, the same system-wide monotonic
clock as the bench's when both run on one machine). Those records are served in tailguard's own format at
``GET /v1/requests/{id}``, and the final SSE chunk carries a ``tailguard`` stage object, so the stage join can be
tested without the real server.

It binds 127.0.0.1 only and exits by itself after ``max_lifetime`` seconds.

    python -m tailguard.bench.fakeserver --port 8011 --ttft 0.05 --itl 0.01 --jitter 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import httptools


@dataclass
class FakeScript:
    """What the fake server does with each request (times in seconds)."""

    ttft: float = 0.02  # parse of the request -> first content chunk handed to the socket
    itl: float = 0.005  # gap between consecutive chunks
    jitter: float = 0.0  # each wait is multiplied by 1 + U(-jitter, +jitter)
    ttft_per_prompt_token: float = 0.0  # extra TTFT per prompt token (prompt tokens = whitespace words)
    output_tokens: int | None = None  # tokens to produce; None: the request's max_tokens
    eos_after: int | None = None  # stop early (finish_reason "stop") after this many tokens unless ignore_eos
    multi_token_every: int = 0  # every k-th chunk carries ``multi_token_size`` tokens (0: never)
    multi_token_size: int = 2
    token_text: str = " tok"
    timeline: bool = True  # tailguard-style: final-chunk stage object and GET /v1/requests/{id}
    accept_fixed_length: bool = True  # False: answer 400 to ignore_eos / min_tokens, as a strict API does
    usage: str = "request"  # "request": usage chunk when stream_options.include_usage; "always"; "never"
    error_every: int = 0  # every k-th request fails with ``error_status`` (0: never)
    error_status: int = 500
    seed: int = 0
    max_lifetime: float = 300.0  # the server exits by itself after this many seconds
    spin: float = 0.0  # last seconds of each wait spent polling the loop instead of sleeping (sharper timing)
    keep_records: int = 100_000
    # per API key (the bearer token of ``Authorization``): seconds added to the TTFT, and the gap between chunks
    # instead of ``itl``, so that traffic classes with different keys see different, known latencies
    key_delays: dict[str, float] = field(default_factory=dict)
    key_itl: dict[str, float] = field(default_factory=dict)
    # a JSON line per completion request received (its ID, a digest of its prompt, max_tokens, key), appended to this
    # file: what a server that the bench starts and stops (bench ab) was sent, kept after it exits
    received_log: str | None = None
    # > 0: act like a tailguard gateway of that many replicas and export tailguard_gateway_replica_seconds_total
    # (replicas x seconds alive) on /metrics, so that replica-seconds can be read as from a gateway
    replicas: int = 0


def _script_rng(script: FakeScript, request_id: str) -> random.Random:
    return random.Random(f"{script.seed}:{request_id}")


def plan(script: FakeScript, request_id: str, max_tokens: int, prompt_tokens: int = 0,
         ignore_eos: bool = False, api_key: str | None = None) -> tuple[float, list[tuple[float, int]], str]:
    """The scripted response: (ttft, [(gap before chunk, tokens in chunk), ...], finish reason).

    The first chunk's gap is 0 (it is sent at TTFT). Deterministic in (seed, request id, API key), so tests can
    recompute it.
    """
    rng = _script_rng(script, request_id)
    j = script.jitter

    def wait(base: float) -> float:
        return max(0.0, base * (1.0 + rng.uniform(-j, j))) if j else base

    n = script.output_tokens if script.output_tokens is not None else max_tokens
    n = max(1, min(n, max_tokens))
    finish = "length"
    if script.eos_after is not None and not ignore_eos and script.eos_after < n:
        n, finish = max(1, script.eos_after), "stop"
    extra = script.key_delays.get(api_key, 0.0) if api_key is not None else 0.0
    itl = script.key_itl.get(api_key, script.itl) if api_key is not None else script.itl
    ttft = wait(script.ttft + extra + script.ttft_per_prompt_token * prompt_tokens)
    chunks: list[tuple[float, int]] = []
    left = n
    i = 0
    while left > 0:
        size = script.multi_token_size if script.multi_token_every and (i + 1) % script.multi_token_every == 0 else 1
        size = min(size, left)
        chunks.append((0.0 if i == 0 else wait(itl), size))
        left -= size
        i += 1
    return ttft, chunks, finish


@dataclass
class _Record:
    request_id: str
    endpoint: str
    stream: bool
    received: float
    received_unix: float
    ttft_script: float
    prompt_tokens: int
    token_sent: list[float] = field(default_factory=list)
    chunk_sent: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    last_byte: float | None = None
    status: int = 200
    finish_reason: str | None = None
    output_tokens: int = 0
    api_key: str | None = None  # the bearer token it came with: shown by /_fake/records only

    def stages(self) -> dict[str, float]:
        # A fake split of TTFT into tokenize / queue / prefill (5% / 25% / 70% of the scripted TTFT), then the real
        # decode (first -> last chunk sent) and stream (last chunk -> last byte) gaps. They add up to E2E exactly.
        end = self.last_byte if self.last_byte is not None else time.perf_counter()
        first = self.chunk_sent[0] if self.chunk_sent else end
        last = self.chunk_sent[-1] if self.chunk_sent else end
        tok = min(self.received + 0.05 * self.ttft_script, first)
        sched = min(self.received + 0.30 * self.ttft_script, first)
        return {"tokenize": tok - self.received, "queue": sched - tok, "prefill": first - sched,
                "decode": last - first, "stream": end - last}

    def to_record(self, private: bool = False) -> dict[str, Any]:
        """The same shape as tailguard.observe.timeline.Timeline.to_record(); ``private`` adds the API key."""
        r0 = self.received
        st = self.stages()
        end = self.last_byte if self.last_byte is not None else time.perf_counter()
        ttft = self.chunk_sent[0] - r0 if self.chunk_sent else None
        e2e = end - r0
        n = self.output_tokens
        cum = r0
        ts = {"received": 0.0}
        for name, key in (("tokenize", "tokenized"), ("queue", "scheduled"), ("prefill", "first_token"),
                          ("decode", "last_token"), ("stream", "last_byte")):
            cum += st[name]
            ts[key] = round(cum - r0, 6)
        ts["first_sent"] = round(self.chunk_sent[0] - r0, 6) if self.chunk_sent else None
        return {
            "request_id": self.request_id, "received_at": self.received_unix, "endpoint": self.endpoint,
            "model": "fake", "user": None, "business_type": "default", "stream": self.stream,
            "status": self.status, "outcome": "success" if self.status == 200 else "error",
            "finish_reason": self.finish_reason, "error": None, "prompt_tokens": self.prompt_tokens,
            "output_tokens": n, "preemptions": 0, "e2e": e2e, "ttft": ttft,
            "tpot": (e2e - ttft) / (n - 1) if ttft is not None and n > 1 else None,
            "stages": st, "timestamps": ts,
            "token_times": [round(t - r0, 6) for t in self.token_sent],
            "token_sent": [round(t - r0, 6) for t in self.token_sent],
            # Only the fake has this: absolute perf_counter times, for same-machine timing-error checks.
            "_clock": {"received": self.received, "chunk_sent": self.chunk_sent, "chunk_tokens": self.chunk_tokens,
                       "last_byte": end},
            **({"_api_key": self.api_key} if private else {}),
        }


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


class ReceivedLogError(ValueError):
    """The --received-log file cannot be opened (opened before the port is bound)."""


class _Server:
    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self.records: dict[str, _Record] = {}
        self.order: list[str] = []
        self.count = 0
        self.stop_event: asyncio.Event | None = None
        self.started = time.monotonic()
        self.received = None
        if script.received_log:
            try:
                self.received = open(script.received_log, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as exc:  # its own error: not to be read as the port failing to bind
                raise ReceivedLogError(f"cannot open the --received-log file {script.received_log}: "
                                       f"{exc.strerror or exc}") from None

    def note(self, rid: str, path: str, text: str, max_tokens: int, key: str | None) -> None:
        if self.received is None:
            return
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
        self.received.write(json.dumps({"request_id": rid, "path": path, "prompt_sha256": digest,
                                        "max_tokens": max_tokens, "key": key, "received_unix": time.time()}) + "\n")
        self.received.flush()  # the bench may stop this process any moment after the answer

    def keep(self, rec: _Record) -> None:
        self.records[rec.request_id] = rec
        self.order.append(rec.request_id)
        if len(self.order) > self.script.keep_records:
            self.records.pop(self.order.pop(0), None)


class _Conn(asyncio.Protocol):
    """One client connection. ``httptools`` (llhttp, the parser uvicorn uses) parses the requests; they are answered
    one after another, in order, as HTTP/1.1 requires of pipelined requests."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[tuple[str, str, dict[str, str], bytes, float, bool]] = deque()
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._respond(400, b'{"error":{"message":"malformed HTTP request"}}', extra="Connection: close\r\n")
            if self.transport is not None:
                self.transport.close()
            return
        if not self.busy:
            self._next()

    # --- httptools callbacks (called from inside feed_data)

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1").strip()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.pending.append((self.parser.get_method().decode("latin-1"), self._url.decode("latin-1"),
                             self._headers, b"".join(self._body), time.perf_counter(),
                             self.parser.should_keep_alive()))

    def _next(self) -> None:
        if not self.pending or self.closed:
            return
        method, target, headers, body, at, keep_alive = self.pending.popleft()
        self.busy = True
        self.loop.create_task(self._handle(method, target, headers, body, at, keep_alive))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _respond(self, status: int, body: bytes, ctype: str = "application/json", extra: str = "") -> None:
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n")
        self._write(head.encode() + body)

    async def _handle(self, method: str, target: str, headers: dict, body: bytes, at: float,
                      keep_alive: bool) -> None:
        try:
            await self._dispatch(method, target.split("?")[0], headers, body, at)
        except Exception as exc:  # a bug in the fake must show, not hang the client
            self._respond(500, json.dumps({"error": {"message": repr(exc)}}).encode())
        finally:
            self.busy = False
            if not keep_alive and self.transport is not None:
                self.transport.close()
            else:
                self._next()

    async def _dispatch(self, method: str, path: str, headers: dict, body: bytes, at: float) -> None:
        srv = self.server
        if path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
            await self._completion(path, headers, body, at)
        elif path == "/v1/models":
            self._respond(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())
        elif path in ("/health", "/healthz"):
            self._respond(200, b'{"status":"ok"}')
        elif path == "/metrics" and srv.script.replicas > 0:
            alive = time.monotonic() - srv.started
            body = ("# TYPE tailguard_gateway_replica_seconds counter\n"
                    f'tailguard_gateway_replica_seconds_total{{model="fake",source="static"}} '
                    f"{srv.script.replicas * alive:.6f}\n").encode()
            self._respond(200, body, ctype="text/plain; version=0.0.4")
        elif path.startswith("/v1/requests/") and srv.script.timeline:
            rec = srv.records.get(path.rsplit("/", 1)[1])
            if rec is None:
                self._respond(404, b'{"error":{"message":"no such request"}}')
            else:
                self._respond(200, json.dumps(rec.to_record()).encode())
        elif path == "/_fake/records":
            recs = [srv.records[i].to_record(private=True) for i in srv.order if i in srv.records]
            self._respond(200, json.dumps(recs).encode())
        elif path == "/_fake/shutdown" and method == "POST":
            self._respond(200, b"{}")
            if srv.stop_event is not None:
                srv.stop_event.set()
        else:
            self._respond(404, b'{"error":{"message":"not found"}}')

    async def _sleep_until(self, deadline: float) -> None:
        spin = self.server.script.spin
        now = time.perf_counter()
        if deadline - now > spin:
            await asyncio.sleep(deadline - now - spin)
        while time.perf_counter() < deadline:
            await asyncio.sleep(0)

    async def _completion(self, path: str, headers: dict, body: bytes, at: float) -> None:
        srv, script = self.server, self.server.script
        srv.count += 1
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            self._respond(400, b'{"error":{"message":"invalid JSON"}}')
            return
        rid = headers.get("x-request-id") or f"fake-{uuid.uuid4().hex[:12]}"
        chat = path.endswith("chat/completions")
        stream = bool(req.get("stream"))
        if not script.accept_fixed_length and ("ignore_eos" in req or "min_tokens" in req):
            self._respond(400, json.dumps({"error": {"message": "Unrecognized request argument supplied: ignore_eos",
                                                     "type": "invalid_request_error"}}).encode())
            return
        if script.error_every and srv.count % script.error_every == 0:
            self._respond(script.error_status, b'{"error":{"message":"scripted failure"}}',
                          extra=f"X-Request-ID: {rid}\r\n")
            return
        if chat:
            text = " ".join(str(m.get("content", "")) for m in req.get("messages", []))
        else:
            text = str(req.get("prompt", ""))
        prompt_tokens = max(1, len(text.split()))
        max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        srv.note(rid, path, text, max_tokens, key)
        ttft, chunks, finish = plan(script, rid, max_tokens, prompt_tokens, bool(req.get("ignore_eos")), key)
        rec = _Record(rid, path, stream, at, time.time(), ttft, prompt_tokens, api_key=key)
        model = req.get("model", "fake")
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        so = req.get("stream_options") or {}
        want_usage = script.usage == "always" or (script.usage == "request" and bool(so.get("include_usage")))
        continuous = want_usage and bool(so.get("continuous_usage_stats"))
        n_out = sum(s for _, s in chunks)

        def usage(done: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        def choice(content: str, fin: str | None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": fin}
            return {"index": 0, "text": content, "finish_reason": fin}

        deadline = at + ttft
        if not stream:
            for gap, _ in chunks:
                deadline += gap
            await self._sleep_until(deadline)
            now = time.perf_counter()
            for _, size in chunks:
                rec.token_sent.extend([now] * size)
            rec.chunk_sent, rec.chunk_tokens = [now], [n_out]
            rec.output_tokens, rec.finish_reason = n_out, finish
            content = "".join(script.token_text * s for _, s in chunks)
            ch = {"index": 0, "finish_reason": finish}
            ch.update({"message": {"role": "assistant", "content": content}} if chat else {"text": content})
            rec.last_byte = time.perf_counter()
            srv.keep(rec)
            st = rec.stages()
            timing = ", ".join(f"{k};dur={v * 1e3:.3f}" for k, v in st.items())
            timing += f", ttft;dur={(now - at) * 1e3:.3f}, total;dur={(rec.last_byte - at) * 1e3:.3f}"
            out = {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": model, "choices": [ch], "usage": usage(n_out)}
            self._respond(200, json.dumps(out).encode(),
                          extra=f"X-Request-ID: {rid}\r\nServer-Timing: {timing}\r\n")
            return

        w = self._write
        w((f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
           f"Transfer-Encoding: chunked\r\nX-Request-ID: {rid}\r\n\r\n").encode())

        def event(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
            raw = f"data: {data}\n\n".encode()
            w(b"%x\r\n%s\r\n" % (len(raw), raw))

        base = {"id": f"chatcmpl-{rid}", "object": obj, "created": created, "model": model}
        if chat:  # like vLLM: a first chunk with the role and no content (not a token)
            event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None}]})
        done = 0
        for i, (gap, size) in enumerate(chunks):
            deadline += gap
            await self._sleep_until(deadline)
            if self.closed:
                break
            done += size
            last = i == len(chunks) - 1
            payload = {**base, "choices": [choice(script.token_text * size, finish if last and not chat else None)]}
            if continuous:
                payload["usage"] = usage(done)
            now = time.perf_counter()
            event(payload)
            rec.chunk_sent.append(now)
            rec.chunk_tokens.append(size)
            rec.token_sent.extend([now] * size)
        rec.output_tokens, rec.finish_reason = done, finish
        final_choices = [choice("", finish)] if chat else []
        tail = time.perf_counter()
        if final_choices or script.timeline:
            payload = {**base, "choices": final_choices}
            if script.timeline:
                rec.last_byte = tail
                st = rec.stages()
                payload["tailguard"] = {"request_id": rid, "stages": {k: round(v, 6) for k, v in st.items()},
                                        "e2e": round(tail - at, 6), "ttft": round(rec.chunk_sent[0] - at, 6),
                                        "queue_wait": round(st["queue"], 6), "prompt_tokens": prompt_tokens,
                                        "output_tokens": done}
            event(payload)
        if want_usage:
            event({**base, "choices": [], "usage": usage(done)})
        event("[DONE]")
        w(b"0\r\n\r\n")
        rec.last_byte = time.perf_counter()
        srv.keep(rec)


async def serve(script: FakeScript, port: int = 0, ready=None, host: str = "127.0.0.1") -> None:
    """Run until shut down (``POST /_fake/shutdown``) or ``max_lifetime`` passes; ``ready(port)`` once listening."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("the fake server binds loopback only")
    srv = _Server(script)
    srv.stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(srv), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready(bound)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(srv.stop_event.wait(), timeout=script.max_lifetime)
    server.close()
    if srv.received is not None:
        srv.received.close()


def run_server(script: FakeScript, port: int, ready=None) -> None:
    """Serve in this process (uvloop when present) until shut down or ``script.max_lifetime`` passes."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(serve(script, port, ready=ready))


class FakeServerProcess:
    """The fake server in its own process (so that its timing does not share a GIL with the bench)."""

    def __init__(self, script: FakeScript | None = None, port: int = 0) -> None:
        self.script = script or FakeScript()
        self.port = port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> FakeServerProcess:
        cmd = [sys.executable, "-m", "tailguard.bench.fakeserver", "--port", str(self.port),
               "--script-json", json.dumps(asdict(self.script))]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("LISTENING "):
                self.port = int(line.split()[1])
                return self
        self.stop()
        raise RuntimeError("the fake server did not start")

    def records(self) -> list[dict]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/_fake/records", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            import urllib.request

            with contextlib.suppress(Exception):
                urllib.request.urlopen(urllib.request.Request(self.url + "/_fake/shutdown", method="POST"), timeout=2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(3)
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(3)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> FakeServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8011)
    for f in ("ttft", "itl", "jitter", "max_lifetime", "spin"):
        p.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(FakeScript, f))
    p.add_argument("--multi-token-every", type=int, default=0)
    p.add_argument("--multi-token-size", type=int, default=2)
    p.add_argument("--no-timeline", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--received-log", default=None)
    p.add_argument("--replicas", type=int, default=0)
    p.add_argument("--script-json", default=None, help="a whole FakeScript as JSON (overrides the other flags)")
    a = p.parse_args(argv)
    if a.script_json:
        script = FakeScript(**json.loads(a.script_json))
        run_server(script, a.port, lambda port: print(f"LISTENING {port}", flush=True))
        return 0
    script = FakeScript(ttft=a.ttft, itl=a.itl, jitter=a.jitter, max_lifetime=a.max_lifetime, spin=a.spin,
                        multi_token_every=a.multi_token_every, multi_token_size=a.multi_token_size,
                        timeline=not a.no_timeline, seed=a.seed, received_log=a.received_log, replicas=a.replicas)
    run_server(script, a.port, lambda port: print(f"fake OpenAI server on http://127.0.0.1:{port} "
                                            f"(exits after {script.max_lifetime:.0f} s)", flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
