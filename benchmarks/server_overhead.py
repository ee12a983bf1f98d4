"""What the HTTP layer adds: tailguard's server versus calling the same fake engine directly.

Both paths drive the same scripted FakeEngine (fixed time to first token and inter-token gap, no jitter), so whatever
the HTTP path adds is the server's own cost plus loopback and a minimal client:

- direct: N concurrent consumers call ``FakeEngine.generate`` in this process (pre-tokenized prompt);
- http:   N concurrent keep-alive connections stream ``POST /v1/chat/completions`` from ``tailguard serve --model fake``
          (a subprocess) with a raw-socket HTTP/1.1 client, so the client's own cost stays small.

Reported per concurrency (1, 64, 256 streams), P50 and P99:
- per request: client-side E2E, HTTP minus direct (difference of the percentiles: the two runs are not paired);
- per streamed token: client-side inter-token gap, HTTP minus direct;
- and, from the server's own timelines in its request store: its per-request work (tokenize + queue hand-off +
  stream stages) and each token's delivery lag (engine produced it -> server handed its chunk to the socket).

    python benchmarks/server_overhead.py            # ~1 minute
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
import time
from pathlib import Path

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.request import SamplingParams

ROOT = Path(__file__).resolve().parent
PROMPT = "Tell me about the history of Hangzhou in a few sentences, please."


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# --- direct ---------------------------------------------------------------------------------------------------------
async def run_direct(timing: FakeTiming, concurrency: int, per_stream: int, tokens: int) -> dict:
    engine = FakeEngine(timing)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    e2e: list[float] = []
    itl: list[float] = []

    async def stream(k: int) -> None:
        for i in range(per_stream):
            sp = SamplingParams(max_tokens=tokens, temperature=0)
            t0 = time.perf_counter()
            times = []
            async for _ev in engine.generate(ids, sp, f"d{k}-{i}"):
                times.append(time.perf_counter())
            e2e.append(times[-1] - t0)
            itl.extend(gaps(times))

    await asyncio.gather(*(stream(k) for k in range(concurrency)))
    return {"e2e": e2e, "itl": itl}


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


def start_server(timing: FakeTiming, store: Path, cfg_path: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg_path.write_text(json.dumps({
        "model": "fake", "max_queue": 100000, "access_log": False, "log_level": "warning",
        "fake": {"ttft": timing.ttft, "itl": timing.itl, "jitter": 0.0, "max_num_seqs": timing.max_num_seqs},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--config", str(cfg_path), "--port",
                             str(port), "--store", str(store)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
            raise RuntimeError(proc.stderr.read().decode())
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
    row["added_request_ms_mean"] = (statistics.fmean(http["e2e"]) - statistics.fmean(direct["e2e"])) * ms
    row["server_records"] = server["records"]
    return row


def print_table(rows: list[dict]) -> None:
    head = ("streams", "reqs", "E2E direct p50/p99 ms", "E2E http p50/p99 ms", "added/request p50/p99 ms",
            "added/token p50/p99 us", "server work p50/p99 ms", "server token lag p50/p99 us")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([
            f"{r['streams']}", f"{r['requests']}",
            f"{r['direct_e2e_ms_p50']:.2f} / {r['direct_e2e_ms_p99']:.2f}",
            f"{r['http_e2e_ms_p50']:.2f} / {r['http_e2e_ms_p99']:.2f}",
            f"{r['added_request_ms_p50']:.2f} / {r['added_request_ms_p99']:.2f}",
            f"{r['added_token_us_p50']:.0f} / {r['added_token_us_p99']:.0f}",
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
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "server_overhead.json"))
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.requests = [1, 16], 32
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    timing = FakeTiming(ttft=args.ttft, itl=args.itl, jitter=0.0, max_num_seqs=4096)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "requests.sqlite3"
        proc, port = start_server(timing, store, Path(tmp) / "server.json")
        try:
            for c in args.concurrency:
                per_stream = max(2, args.requests // c)
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    runner.run(run_http(port, min(c, 8), 1, args.tokens, f"warm{c}"))  # connections, caches
                    direct = runner.run(run_direct(timing, c, per_stream, args.tokens))
                    http = runner.run(run_http(port, c, per_stream, args.tokens, f"c{c}"))
                server = server_side(store, f"c{c}", len(http["ids"]))
                row = summarize(direct, http, server, c, args.tokens)
                rows.append(row)
                print(f"  {c} streams: {row['requests']} requests, added {row['added_request_ms_p50']:.2f} / "
                      f"{row['added_request_ms_p99']:.2f} ms", file=sys.stderr)
        finally:
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
        "fake_engine": {"ttft_s": args.ttft, "itl_s": args.itl, "tokens": args.tokens},
        "method": "difference of client-side percentiles, HTTP (raw-socket client, keep-alive, chat streaming) vs "
                  "direct FakeEngine.generate; server work = tokenize + queue + stream stages; token lag = chunk "
                  "handed to the socket minus engine production time",
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(meta, indent=2))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
