"""What connection hygiene costs: requests/s and latency of ``tailguard serve``'s app under plain uvicorn (httptools),
under the guarded protocol it runs now (serving/connections.py), and under the servers that have a header size limit
of their own: uvicorn's h11 protocol (``h11_max_incomplete_event_size``) and, when importable, hypercorn.

Every variant serves the same app (``create_app`` over the fake engine, no delays, a SQLite store) in its own process
pinned to CPU 0; the load generator (closed loop, raw keep-alive connections, uvloop) runs pinned to CPU 1. Rounds
alternate the variants (ABCD, BCDA, ...), so a neighbour's load on a shared machine falls on every variant alike;
the report gives each variant's median over rounds and its paired ratio to plain uvicorn. On a busy machine the
requests/s move with the neighbours' load; the server's own CPU time per request (``cpu_us``, from /proc) and the
single-connection latency (``health1``: one request at a time, no queueing) move much less: those decide.

Workloads: ``health`` (GET /health, the cheapest route: the protocol's share is largest), ``completion`` (POST
/v1/completions, max_tokens 1: the whole request path), ``connect`` (GET /health on a new connection each time: the
connection set-up and close paths, where the guard counts and times connections).

    python benchmarks/connection_guard.py --rounds 4 --seconds 3 --out benchmarks/results/connection_guard.json
    python benchmarks/connection_guard.py --micro   # the protocol alone, in-process: CPU time per request/connection

``--micro`` drives the two protocols (plain and guarded) in-process over a stub transport with a trivial app, and
reports the least CPU time of 9 runs per request on a kept-alive connection and per new connection (one request,
``Connection: close``): what the guard itself adds, without the kernel, the app or the neighbours' noise.
    PYTHONPATH=/path/with/hypercorn python benchmarks/connection_guard.py ...   # adds the hypercorn variant
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = {
    "health": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True),
    "health1": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True),  # one connection: the added latency
    "completion": (None, True),  # built in main (its content-length)
    "connect": (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False),
}
COMPLETION = json.dumps({"model": "fake", "prompt": "hello", "max_tokens": 1}).encode()


# --- the servers --------------------------------------------------------------------------------------------------
def _app(tmp: str) -> Any:
    from tailguard.engine.fake import FakeEngine, FakeTiming
    from tailguard.serving.app import create_app
    from tailguard.serving.config import ServerConfig

    config = ServerConfig(model="fake", host="127.0.0.1", port=0, access_log=False, log_level="warning",
                          store_path=str(Path(tmp) / "requests.sqlite3"))
    return config, create_app(config, engine=FakeEngine(FakeTiming(ttft=0.0, itl=0.0)))


def serve(variant: str, port: int) -> None:
    os.sched_setaffinity(0, {0})
    tmp = tempfile.mkdtemp(prefix="tg-connbench-")
    config, app = _app(tmp)
    if variant == "hypercorn":
        import uvloop
        from hypercorn.asyncio import serve as hyper_serve
        from hypercorn.config import Config as HyperConfig

        hc = HyperConfig()
        hc.bind = [f"127.0.0.1:{port}"]
        hc.accesslog = None
        hc.errorlog = None
        hc.h11_max_incomplete_size = 64 * 1024
        hc.include_server_header = False
        hc.keep_alive_max_requests = 1 << 30  # uvicorn has no such limit: a closed keep-alive is not what we time
        uvloop.run(hyper_serve(app, hc))  # type: ignore[arg-type]
        return
    import uvicorn

    from tailguard.serving.connections import ConnectionGuard, ConnectionLimits

    http: dict[str, Any] = {
        "plain": {"http": "httptools"},
        "guarded": {"http": ConnectionGuard(ConnectionLimits.from_config(config)).protocol_class()},
        "h11": {"http": "h11", "h11_max_incomplete_event_size": 64 * 1024},
    }[variant]
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", lifespan="on", ws="none",
                                  log_level="warning", access_log=False, server_header=False, timeout_keep_alive=5,
                                  **http)).run()


def _start(variant: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, __file__, "--serve", variant, "--port", str(port)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(WORKLOADS["health"][0])  # type: ignore[arg-type]
                if c.recv(64).startswith(b"HTTP/1.1 200"):
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{variant} did not start")


# --- the load -----------------------------------------------------------------------------------------------------
async def _read_response(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)


async def _worker(port: int, request: bytes, keepalive: bool, stop_at: float, lat: list[float]) -> None:
    conn = None
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        if conn is None:
            conn = await asyncio.open_connection("127.0.0.1", port)
        reader, writer = conn
        writer.write(request)
        try:
            await _read_response(reader)
        except (asyncio.IncompleteReadError, ConnectionError):  # the server closed a kept-alive connection
            writer.close()
            conn = None
            continue
        lat.append(time.perf_counter() - t0)
        if not keepalive:
            writer.close()
            conn = None
    if conn is not None:
        conn[1].close()


def _cpu_s(pid: int) -> float:
    """The process's user + system CPU time (all its threads: the event loop and the store's writer)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, request: bytes, keepalive: bool, seconds: float, conns: int,
                pid: int) -> dict[str, float]:
    lat: list[float] = []
    warm = time.perf_counter() + 0.5  # connections up, caches warm: not counted
    await asyncio.gather(*(_worker(port, request, keepalive, warm, []) for _ in range(conns)))
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    await asyncio.gather(*(_worker(port, request, keepalive, t0 + seconds, lat) for _ in range(conns)))
    took, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    lat.sort()
    return {"rps": len(lat) / took, "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
            "cpu_us": cpu / len(lat) * 1e6, "requests": len(lat)}


class _StubTransport:
    """Just enough of a transport for uvicorn's protocol: writes are dropped."""

    def __init__(self) -> None:
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    abort = close

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _micro_run(cls: Any, config: Any, connections: int, per_connection: int) -> float:
    from uvicorn.server import ServerState

    state = ServerState()
    loop = asyncio.get_running_loop()
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + (b"Connection: close\r\n" if per_connection == 1 else b"") + \
        b"\r\n"
    t0 = time.process_time()
    for _ in range(connections):
        proto = cls(config=config, server_state=state, app_state={}, _loop=loop)
        proto.connection_made(_StubTransport())
        for _ in range(per_connection):
            proto.data_received(request)
            await asyncio.sleep(0)  # the app's task runs and answers
            await asyncio.sleep(0)
        proto.connection_lost(None)
    return (time.process_time() - t0) / (connections * per_connection) * 1e6


async def _micro() -> dict[str, Any]:
    import gc

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from tailguard.serving.connections import ConnectionGuard, ConnectionLimits

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    config = uvicorn.Config(app, log_level="warning", access_log=False, ws="none", http="httptools")
    config.load()
    variants = {"plain": HttpToolsProtocol, "guarded": ConnectionGuard(ConnectionLimits()).protocol_class()}
    best = {v: {"keepalive_us_per_request": 1e9, "new_connection_us": 1e9} for v in variants}
    for _ in range(9):
        for v, cls in variants.items():
            gc.collect()
            b = best[v]
            b["keepalive_us_per_request"] = min(b["keepalive_us_per_request"], await _micro_run(cls, config, 500, 40))
            b["new_connection_us"] = min(b["new_connection_us"], await _micro_run(cls, config, 10000, 1))
    return {v: {k: round(x, 2) for k, x in b.items()} for v, b in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--workloads", default="health,health1,completion,connect")
    ap.add_argument("--variants", default="plain,guarded,h11,hypercorn")
    ap.add_argument("--out", default=None)
    ap.add_argument("--micro", action="store_true", help="the protocol alone, in-process (see above)")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    import uvloop

    if args.micro:
        result = uvloop.run(_micro())
        print(json.dumps(result, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps({"micro": result}, indent=1) + "\n")
        return

    os.sched_setaffinity(0, {1})
    variants = args.variants.split(",")
    if "hypercorn" in variants:
        try:
            import hypercorn  # noqa: F401
        except ImportError:
            variants.remove("hypercorn")
            print("hypercorn is not importable: its variant is left out", file=sys.stderr)
    workloads = args.workloads.split(",")
    requests = {"completion": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              + f"Content-Length: {len(COMPLETION)}\r\n\r\n".encode() + COMPLETION}
    servers = {v: _start(v) for v in variants}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {w: {v: [] for v in variants} for w in workloads}
    try:
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for w in workloads:
                request, keepalive = WORKLOADS[w]
                request = request or requests[w]
                for v in order:
                    proc, port = servers[v]
                    conns = 1 if w == "health1" else args.conns
                    res = uvloop.run(_load(port, request, keepalive, args.seconds, conns, proc.pid))
                    runs[w][v].append(res)
                    print(f"round {r} {w:10s} {v:9s} {res['rps']:8.0f} req/s  p50 {res['p50_ms']:6.2f} ms  "
                          f"p99 {res['p99_ms']:6.2f} ms  cpu {res['cpu_us']:6.0f} us/req", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    summary: dict[str, Any] = {}
    for w in workloads:
        base = runs[w]["plain"]
        summary[w] = {}
        for v in variants:
            rs = runs[w][v]
            summary[w][v] = {k: round(statistics.median(x[k] for x in rs), 3)
                             for k in ("rps", "p50_ms", "p99_ms", "cpu_us")}
            for k in ("rps", "cpu_us", "p50_ms"):  # each round's ratio to plain uvicorn's run beside it
                paired = [a[k] / b[k] for a, b in zip(rs, base, strict=True)]
                summary[w][v][f"{k}_vs_plain_paired_median"] = round(statistics.median(paired), 4)
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "cpu": os.cpu_count(), "summary": summary,
                                              "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
