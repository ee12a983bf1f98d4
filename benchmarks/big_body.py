"""What a huge request costs everybody else: /health latency and a neighbour's stream gaps while attackers send
15 MB chat bodies, or the longest prompts the byte bound lets through (tokenized, then refused as too long).

One `tailguard serve --model smollm2` (real model) at a time; per phase (quiet, then each attack) a thread pings
/health every 20 ms and another streams 64-token answers back to back. Each attacker (a process of its own) sends its
body, reads the answer, pauses 0.5 s and sends again; one phase floods with six and no pause. Reported: P50/P99/max of
each, and what the attack added over the first quiet phase (same run). The target: a 15 MB body costs other requests under 50 ms.

    python benchmarks/big_body.py                      # ~1 minute
    python benchmarks/big_body.py --src /tmp/old/src   # the server from another source tree (a before column)
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BIG_BODY_BYTES = 15_000_000


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(src: str | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--model", "smollm2", "--port",
                             str(port), "--no-slo", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not get ready: " + proc.stderr.read().decode()[-2000:])


class Victims:
    """/health pings and one neighbour's stream, recorded while ``running``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.health: list[float] = []
        self.gaps: list[float] = []
        self.errors = 0  # the victims' failed requests (a reset connection, a refused one)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._ping), threading.Thread(target=self._stream)]

    def __enter__(self) -> Victims:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

    def _ping(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                c.request("GET", "/health")
                c.getresponse().read()
            except (OSError, http.client.HTTPException):
                self.errors += 1  # counted, and the wait it cost is the latency it shows
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            self.health.append(time.perf_counter() - t0)
            time.sleep(0.02)

    def _stream(self) -> None:
        body = json.dumps({"model": "smollm2", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                           "stream": True, "messages": [{"role": "user", "content": "Tell me about Hangzhou."}]})
        while not self.stop.is_set():
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            last = None
            try:
                c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                r = c.getresponse()
                while True:
                    line = r.readline()
                    if not line:
                        break
                    if line.startswith(b"data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                        last = now
            except (OSError, http.client.HTTPException):
                self.errors += 1
            finally:
                c.close()


def send_raw(port: int, payload: bytes) -> tuple[int, float]:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(OSError):  # refused before the whole body went out: the answer is already there
            s.sendall(head + payload)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, time.perf_counter() - t0


def big_body(chars: int, text: str) -> bytes:
    return json.dumps({"model": "smollm2", "max_tokens": 8,
                       "messages": [{"role": "user", "content": (text * (chars // len(text) + 1))[:chars]}]},
                      ensure_ascii=False).encode()


def _attacker(port: int, payload: bytes, seconds: float, pause: float) -> list[tuple[int, float]]:
    results = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        results.append(send_raw(port, payload))
        time.sleep(pause)
    return results


def attack(port: int, payload: bytes, concurrency: int, seconds: float, pause: float) -> dict:
    # Attackers are processes of their own: in this one they would take the GIL from the victims' clients.
    with multiprocessing.get_context("spawn").Pool(concurrency) as pool:
        runs = pool.starmap(_attacker, [(port, payload, seconds, pause)] * concurrency)
    results = [r for run in runs for r in run]
    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"sent": len(results), "statuses": statuses, "answer_s_p50": pct([d for _, d in results], 0.5)}


def phase(port: int, name: str, seconds: float, payload: bytes | None, concurrency: int, pause: float = 0.5) -> dict:
    with Victims(port) as v:
        time.sleep(1.0)  # the neighbour's stream under way
        v.health.clear()
        v.gaps.clear()
        info = attack(port, payload, concurrency, seconds, pause) if payload is not None else (time.sleep(seconds) or {})
    row = {"phase": name, **info, "victim_errors": v.errors}
    for key, values in (("health", v.health), ("gap", v.gaps)):
        row.update({f"{key}_n": len(values), f"{key}_p50_ms": pct(values, 0.5) * 1e3,
                    f"{key}_p99_ms": pct(values, 0.99) * 1e3, f"{key}_max_ms": max(values, default=0) * 1e3})
    print(f"  {name:<28} health p50/p99/max {row['health_p50_ms']:7.1f} {row['health_p99_ms']:7.1f} "
          f"{row['health_max_ms']:7.1f} ms | stream gap p50/p99/max {row['gap_p50_ms']:6.1f} {row['gap_p99_ms']:7.1f} "
          f"{row['gap_max_ms']:7.1f} ms | {info.get('statuses', '')} victim errors {v.errors}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--src", help="run the server from this source tree (PYTHONPATH), e.g. an older checkout")
    ap.add_argument("--label", default="this build")
    ap.add_argument("--out", default=str(ROOT / "results" / "big_body.json"))
    args = ap.parse_args()
    proc, port = start_server(args.src)
    try:
        print(f"{args.label}: tailguard serve --model smollm2 on 127.0.0.1:{port}")
        en = "The quick brown fox jumps over the lazy dog near the river bank. "
        rows = [
            phase(port, "quiet", args.seconds, None, 0),
            phase(port, "one 15 MB body at a time", args.seconds, big_body(BIG_BODY_BYTES, en), 1),
            phase(port, "15 MB bodies x6, no pause", args.seconds, big_body(BIG_BODY_BYTES, en), 6, 0.0),
            phase(port, "600K-char English x2", args.seconds, big_body(600_000, en), 2),
            phase(port, "600K-char Chinese x2", args.seconds, big_body(600_000, "深度学习模型的推理延迟"), 2),
            phase(port, "quiet again", args.seconds, None, 0),
        ]
    finally:
        proc.terminate()
        proc.wait(30)
    quiet = rows[0]
    for r in rows[1:]:
        if r.get("sent") is None:
            continue
        r["added_health_p99_ms"] = r["health_p99_ms"] - quiet["health_p99_ms"]
        r["added_gap_p99_ms"] = r["gap_p99_ms"] - quiet["gap_p99_ms"]
        r["added_health_max_ms"] = r["health_max_ms"] - quiet["health_max_ms"]
        r["added_gap_max_ms"] = r["gap_max_ms"] - quiet["gap_max_ms"]
    print(f"\n| {args.label} | /health P99 added | /health max added | stream gap P99 added | gap max added |")
    print("|---|---|---|---|---|")
    for r in rows[1:]:
        if r.get("sent") is None:
            continue
        print(f"| {r['phase']} | {r['added_health_p99_ms']:+.1f} ms | {r['added_health_max_ms']:+.1f} ms | "
              f"{r['added_gap_p99_ms']:+.1f} ms | {r['added_gap_max_ms']:+.1f} ms |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"label": args.label, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                               "machine": platform.machine(), "phases": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
