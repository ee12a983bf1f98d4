"""What the HTTP layer adds, engine-thread hand-off included: tailguard's server versus the same engine front direct.

The engine is the real thread front, ``AsyncLLMEngine`` (src/tailguard/engine/engine.py), unchanged: its background
thread steps the engine and hands each step's events to the event loop with ``loop.call_soon_threadsafe``. Only the
model under it is replaced, by ``ScriptedStepEngine`` below: an object with ``LLMEngine``'s interface whose ``step()``
blocks the engine thread until the next token is due (as a forward pass does: fixed time to first token, fixed gap
between tokens, no jitter) and then returns every due token. So both paths below cross the same engine-thread ->
event-loop hand-off, and the HTTP path adds exactly the server on top of it:

- direct: N concurrent consumers iterate ``AsyncLLMEngine.generate`` in this process (pre-tokenized prompt);
- http:   N concurrent keep-alive connections stream ``POST /v1/chat/completions`` from tailguard's app serving that
          same threaded engine (a subprocess: this script with ``--serve``, uvicorn + uvloop + httptools as in
          ``tailguard serve``) with a raw-socket HTTP/1.1 client, so the client's own cost stays small.

Reported per concurrency (1, 64, 256 streams), P50 and P99:
- per request: client-side E2E, HTTP minus direct (difference of the percentiles: the two runs are not paired);
- per streamed token: client-side inter-token gap, HTTP minus direct;
- the hand-off itself, direct: each token's arrival at its consumer minus the engine thread's production time;
- and, from the server's own timelines in its request store: its per-request work (tokenize + queue hand-off +
  stream stages) and each token's delivery lag (engine thread produced it -> server handed its chunk to the socket,
  i.e. hand-off + SSE encoding + write).

Before this, the benchmark drove ``FakeEngine``, whose tokens come from asyncio timers on the server's own loop: it
had no engine thread and could not see the hand-off.

    python benchmarks/server_overhead.py            # ~3 minutes
    python benchmarks/server_overhead.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tailguard.engine.engine import AsyncLLMEngine, EngineStats, TokenEvent
from tailguard.engine.fake import ByteTokenizer
from tailguard.engine.sequence import FinishReason, RequestError, SamplingParams

ROOT = Path(__file__).resolve().parent
PROMPT = "Tell me about the history of Hangzhou in a few sentences, please."
OUTPUT_TEXT = "The quick brown fox jumps over the lazy dog. "


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# --- the scripted engine under the real thread front ----------------------------------------------------------------
@dataclass
class _Seq:
    prompt_tokens: int
    max_tokens: int
    arrival: float
    scheduled: float
    due: float  # when its next token is ready
    produced: int = 0
    first: float | None = None


class ScriptedStepEngine:
    """``LLMEngine``'s interface for ``AsyncLLMEngine``, with a script instead of a model.

    ``step()`` runs on the engine thread: it sleeps until the earliest due token (the thread is busy, as during a
    forward pass, and holds no lock the event loop needs), then emits one token for every request that is due. A
    request's first token is due ``ttft`` after the engine thread takes it in, each next one ``itl`` later (absolute
    deadlines: a late step does not push the schedule back).
    """

    def __init__(self, ttft: float, itl: float, max_model_len: int = 8192) -> None:
        self.ttft, self.itl = ttft, itl
        self.tokenizer = ByteTokenizer()
        self.model_name = "fake"
        self.max_model_len = max_model_len
        self.scheduler = self  # AsyncLLMEngine.check_request calls engine.scheduler.check_fits
        self.speculation = None  # never speculates (AsyncLLMEngine.speculates reads it)
        self._live: dict[str, _Seq] = {}
        self._text = [ord(c) for c in OUTPUT_TEXT]
        self.steps = 0

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise RequestError(f"prompt + max_tokens exceed the context window of {self.max_model_len} tokens")

    def add_request(self, prompt: list[int], sampling: SamplingParams, request_id: str, priority: int = 0,
                    arrival: float | None = None) -> None:
        now = time.perf_counter()
        self._live[request_id] = _Seq(len(prompt), sampling.max_tokens, arrival if arrival is not None else now,
                                      now, now + self.ttft)

    def abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def request_ids(self) -> list[str]:
        return list(self._live)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._live), waiting=0, kv_blocks_total=0, kv_blocks_used=0,
                           num_preemptions=0, steps=self.steps)

    def step(self) -> list[TokenEvent]:
        wait = min(s.due for s in self._live.values()) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        now = time.perf_counter()
        self.steps += 1
        events: list[TokenEvent] = []
        for rid, s in list(self._live.items()):
            if s.due > now:
                continue
            byte = self._text[s.produced % len(self._text)]
            s.produced += 1
            s.first = s.first or now
            tok = byte + ByteTokenizer._OFFSET
            if s.produced < s.max_tokens:
                s.due += self.itl
                events.append(TokenEvent(rid, tok, chr(byte), now))
                continue
            del self._live[rid]
            events.append(TokenEvent(rid, tok, chr(byte), now, finished=True, finish_reason=FinishReason.LENGTH,
                                     num_prompt_tokens=s.prompt_tokens, num_output_tokens=s.produced,
                                     arrival=s.arrival, first_scheduled=s.scheduled, first_token=s.first))
        return events


def threaded_engine(ttft: float, itl: float) -> AsyncLLMEngine:
    """The real engine thread front around the scripted engine."""
    return AsyncLLMEngine(ScriptedStepEngine(ttft, itl))  # type: ignore[arg-type]


# --- direct ---------------------------------------------------------------------------------------------------------
async def run_direct(engine: AsyncLLMEngine, concurrency: int, per_stream: int, tokens: int, tag: str) -> dict:
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    e2e: list[float] = []
    itl: list[float] = []
    handoff: list[float] = []

    async def stream(k: int) -> None:
        for i in range(per_stream):
            sp = SamplingParams(max_tokens=tokens, temperature=0)
            t0 = time.perf_counter()
            times = []
            async for ev in engine.generate(ids, sp, f"{tag}-{k}-{i}"):
                now = time.perf_counter()
                times.append(now)
                handoff.append(now - ev.time)  # engine thread produced it -> its consumer has it
            if len(times) != tokens:
                raise RuntimeError(f"direct {tag}-{k}-{i}: {len(times)} events for {tokens} tokens")
            e2e.append(times[-1] - t0)
            itl.extend(gaps(times))

    await asyncio.gather(*(stream(k) for k in range(concurrency)))
    return {"e2e": e2e, "itl": itl, "handoff": handoff}


# --- http -----------------------------------------------------------------------------------------------------------
def _request(port: int, rid: str, tokens: int) -> bytes:
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "temperature": 0, "stream": True}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def _one_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> tuple[float, list]:
    t0 = time.perf_counter()
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode(errors="replace"))
    arrivals: list[float] = []
    while True:  # chunked transfer encoding: one chunk per server send, one token per chunk here
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            await reader.readline()
            break
        await reader.readexactly(size + 2)
        arrivals.append(time.perf_counter())
    return t0, arrivals


async def run_http(port: int, concurrency: int, per_stream: int, tokens: int, tag: str) -> dict:
    e2e: list[float] = []
    itl: list[float] = []
    ids: list[str] = []

    async def stream(k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in range(per_stream):
                rid = f"{tag}-{k}-{i}"
                t0, arrivals = await _one_http(reader, writer, _request(port, rid, tokens))
                if len(arrivals) != tokens:
                    raise RuntimeError(f"{rid}: {len(arrivals)} chunks for {tokens} tokens")
                e2e.append(arrivals[-1] - t0)
                itl.extend(gaps(arrivals))
                ids.append(rid)
        finally:
            writer.close()

    await asyncio.gather(*(stream(k) for k in range(concurrency)))
    return {"e2e": e2e, "itl": itl, "ids": ids}


def server_side(store: Path, tag: str, expected: int) -> dict:
    """Per-request server work and per-token delivery lag, from the server's own records."""
    deadline = time.monotonic() + 30
    while True:
        conn = sqlite3.connect(store)
        rows = conn.execute("SELECT tokenize, queue, stream_time, record FROM requests WHERE request_id LIKE ?",
                            (f"{tag}-%",)).fetchall()
        conn.close()
        if len(rows) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    work, lag = [], []
    for tokenize, queue, stream_t, record in rows:
        work.append(tokenize + queue + stream_t)
        rec = json.loads(record)
        lag.extend(s - t for s, t in zip(rec["token_sent"], rec["token_times"]))
    return {"records": len(rows), "work": work, "lag": lag}


def serve_forever(port: int, store: str, ttft: float, itl: float) -> int:
    """``--serve``: tailguard's app over the threaded scripted engine, until SIGTERM."""
    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import ThreadedServer

    engine = threaded_engine(ttft, itl)
    cfg = ServerConfig(model="fake", port=port, max_queue=100000, access_log=False, log_level="warning",
                       store_path=store)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ThreadedServer(cfg, engine) as srv:
        print(f"LISTENING {srv.port}", flush=True)
        stop.wait()
    engine.shutdown()
    return 0


def start_server(ttft: float, itl: float, store: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--store", str(store), "--ttft", str(ttft),
                             "--itl", str(itl)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("LISTENING "):
        proc.kill()
        raise RuntimeError("the server did not start: " + line + (proc.stderr.read() if proc.stderr else ""))
    port = int(line.split()[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
                if c.recv(100).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read() if proc.stderr else "the server exited")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not become ready")


def summarize(direct: dict, http: dict, server: dict, concurrency: int, tokens: int) -> dict:
    ms, us = 1e3, 1e6
    row = {"streams": concurrency, "requests": len(http["e2e"]), "tokens_per_request": tokens}
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        row[f"direct_e2e_ms_{name}"] = pct(direct["e2e"], q) * ms
        row[f"http_e2e_ms_{name}"] = pct(http["e2e"], q) * ms
        row[f"added_request_ms_{name}"] = (pct(http["e2e"], q) - pct(direct["e2e"], q)) * ms
        row[f"direct_itl_ms_{name}"] = pct(direct["itl"], q) * ms
        row[f"http_itl_ms_{name}"] = pct(http["itl"], q) * ms
        row[f"added_token_us_{name}"] = (pct(http["itl"], q) - pct(direct["itl"], q)) * us
        row[f"server_work_ms_{name}"] = pct(server["work"], q) * ms
        row[f"server_token_lag_us_{name}"] = pct(server["lag"], q) * us
        row[f"direct_handoff_us_{name}"] = pct(direct["handoff"], q) * us
    row["added_request_ms_mean"] = (statistics.fmean(http["e2e"]) - statistics.fmean(direct["e2e"])) * ms
    row["server_records"] = server["records"]
    return row


def print_table(rows: list[dict]) -> None:
    head = ("streams", "reqs", "E2E direct p50/p99 ms", "E2E http p50/p99 ms", "added/request p50/p99 ms",
            "added/token p50/p99 us", "hand-off direct p50/p99 us", "server work p50/p99 ms",
            "server token lag p50/p99 us")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([
            f"{r['streams']}", f"{r['requests']}",
            f"{r['direct_e2e_ms_p50']:.2f} / {r['direct_e2e_ms_p99']:.2f}",
            f"{r['http_e2e_ms_p50']:.2f} / {r['http_e2e_ms_p99']:.2f}",
            f"{r['added_request_ms_p50']:.2f} / {r['added_request_ms_p99']:.2f}",
            f"{r['added_token_us_p50']:.0f} / {r['added_token_us_p99']:.0f}",
            f"{r['direct_handoff_us_p50']:.0f} / {r['direct_handoff_us_p99']:.0f}",
            f"{r['server_work_ms_p50']:.3f} / {r['server_work_ms_p99']:.3f}",
            f"{r['server_token_lag_us_p50']:.0f} / {r['server_token_lag_us_p99']:.0f}",
        ]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--ttft", type=float, default=0.02)
    ap.add_argument("--itl", type=float, default=0.02)
    ap.add_argument("--requests", type=int, default=256, help="requests per concurrency level (at least 2 per stream)")
    ap.add_argument("--quick", action="store_true", help="a smoke run (its results go to a temporary file)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/server_overhead.json")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server subprocess
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_forever(0, args.store, args.ttft, args.itl)
    if args.quick:
        args.concurrency, args.requests = [1, 16], 32
    if args.out is None:
        args.out = (str(Path(tempfile.gettempdir()) / "server_overhead_quick.json") if args.quick
                    else str(ROOT / "results" / "server_overhead.json"))
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    rows = []
    engine = threaded_engine(args.ttft, args.itl)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "requests.sqlite3"
        proc, port = start_server(args.ttft, args.itl, store)
        try:
            for c in args.concurrency:
                per_stream = max(2, args.requests // c)
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    runner.run(run_http(port, min(c, 8), 1, args.tokens, f"warm{c}"))  # connections, caches
                    runner.run(run_direct(engine, min(c, 8), 1, args.tokens, f"dwarm{c}"))
                    direct = runner.run(run_direct(engine, c, per_stream, args.tokens, f"d{c}"))
                    http = runner.run(run_http(port, c, per_stream, args.tokens, f"c{c}"))
                server = server_side(store, f"c{c}", len(http["ids"]))
                row = summarize(direct, http, server, c, args.tokens)
                rows.append(row)
                print(f"  {c} streams: {row['requests']} requests, added {row['added_request_ms_p50']:.2f} / "
                      f"{row['added_request_ms_p99']:.2f} ms", file=sys.stderr)
        finally:
            engine.shutdown()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(rows)
    meta = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "engine": {"front": "AsyncLLMEngine (the real engine thread front: step on a thread, hand-off with "
                            "loop.call_soon_threadsafe)", "under_it": "ScriptedStepEngine (no model)",
                   "ttft_s": args.ttft, "itl_s": args.itl, "tokens": args.tokens},
        "method": "difference of client-side percentiles, HTTP (raw-socket client, keep-alive, chat streaming) vs "
                  "direct AsyncLLMEngine.generate, both over the same threaded engine front; hand-off = consumer "
                  "has the token minus engine thread produced it (direct); server work = tokenize + queue + stream "
                  "stages; server token lag = chunk handed to the socket minus engine production time",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta, indent=2))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
