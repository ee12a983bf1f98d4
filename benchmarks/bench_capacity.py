"""How much load one ``tailguard bench`` process can drive, and how exactly it times what it sees.

Two phases against the fake OpenAI-compatible server (its own process, uvloop, raw asyncio protocol: far faster than
any real server, so the bench is what is measured):

1. capacity: a zero-latency script (every token at once, 16 per answer in 16 chunks), closed loop with many
   streams: completed requests/s and streamed tokens/s, per HTTP client;
2. timing: a paced script (TTFT 10 ms, 2 ms between chunks) at a steady open-loop rate: for every chunk, the
   bench's read timestamp minus the moment the fake server wrote it (both processes read the same system-wide
   monotonic clock), and the bench's send lag behind its schedule.

Each phase is repeated and the medians of the repeats are reported (the machine may be shared and noisy).

    .venv/bin/python benchmarks/bench_capacity.py [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tailguard.bench import runner
from tailguard.bench.fakeserver import FakeScript, FakeServerProcess
from tailguard.bench.runner import BenchConfig, execute

TARGETS = {"requests_per_s": 500.0, "tokens_per_s": 5000.0, "timing_error_ms": 1.0}


def _config(url: str, **kw) -> BenchConfig:
    base = dict(url=url, model="fake", tokenizer="approx", bootstrap=0, join="off", input_tokens=16,
                output_tokens=16, profiles=("baseline",), probe=True)
    base.update(kw)
    return BenchConfig(**base)


def _outcome_spy() -> dict:
    seen: dict = {}
    orig = runner.analyse

    def spy(cfg, workload, plan, outcome, *a, **kw):
        seen["outcome"] = outcome
        return orig(cfg, workload, plan, outcome, *a, **kw)

    runner.analyse = spy
    return seen


def capacity(client: str, requests: int, concurrency: int) -> dict:
    script = FakeScript(ttft=0.0, itl=0.0, max_lifetime=600, keep_records=10)
    seen = _outcome_spy()
    with FakeServerProcess(script) as srv:
        res, _ = asyncio.run(execute(_config(srv.url, concurrency=concurrency, num_requests=requests,
                                             http_client=client), display=False))
    out = seen["outcome"]
    ok = res["summary"]["requests"]["completed"]
    tokens = res["tokens"]["output_tokens_total"]
    wall = out.wall_seconds  # first send to last answer
    return {"client": client, "requests": ok, "failed": res["summary"]["requests"]["failed"],
            "wall_s": wall, "requests_per_s": ok / wall, "tokens_per_s": tokens / wall,
            "bench_cpu_util": out.cpu_seconds / wall}


def timing(requests: int, rate: float) -> dict:
    # no spinning: on a small machine a busy-polling server would steal the very core the bench needs
    script = FakeScript(ttft=0.010, itl=0.002, max_lifetime=600)
    seen = _outcome_spy()
    with FakeServerProcess(script) as srv:
        res, ms = asyncio.run(execute(_config(srv.url, rate=rate, num_requests=requests), display=False))
        recs = {r["request_id"]: r["_clock"] for r in srv.records()}
    out = seen["outcome"]
    chunk_err, first_err, lag = [], [], []
    for r in out.results:
        clk = recs.get(r.request_id)
        if clk is None or not r.ok or len(r.chunk_times) != len(clk["chunk_sent"]):
            continue
        err = np.asarray(r.chunk_times) - np.asarray(clk["chunk_sent"])
        chunk_err.extend(err.tolist())
        first_err.append(float(err[0]))
        lag.append(r.sent - r.intended)
    ce = np.asarray(chunk_err)
    return {"requests": len(first_err), "chunks": int(ce.size), "rate": rate,
            "chunk_error_ms_p50": float(np.percentile(ce, 50) * 1e3),
            "chunk_error_ms_p99": float(np.percentile(ce, 99) * 1e3),
            "first_token_error_ms_p50": float(np.percentile(first_err, 50) * 1e3),
            "first_token_error_ms_p99": float(np.percentile(first_err, 99) * 1e3),
            "send_lag_ms_p50": float(np.percentile(lag, 50) * 1e3),
            "send_lag_ms_p99": float(np.percentile(lag, 99) * 1e3),
            "reported_itl_p50_ms": res["metrics"]["itl"]["percentiles"]["p50"]["value"] * 1e3}


def _median(rows: list[dict], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000, help="requests per capacity run")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--timing-requests", type=int, default=600)
    ap.add_argument("--timing-rate", type=float, default=100.0)
    ap.add_argument("--clients", default="aiohttp,httpx")
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer requests (a smoke run)")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "bench_capacity.json"))
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.requests, a.timing_requests = 1, 1000, 300
    clients = [c.strip() for c in a.clients.split(",") if c.strip()]
    t0 = time.time()
    cap: dict[str, list[dict]] = {c: [] for c in clients}
    tim: list[dict] = []
    for _ in range(a.repeats):
        for c in clients:
            cap[c].append(capacity(c, a.requests, a.concurrency))
        tim.append(timing(a.timing_requests, a.timing_rate))

    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    t = Table(title=f"tailguard bench capacity (one bench process, median of {a.repeats} runs)")
    for col in ("figure", "value", "target", "met"):
        t.add_column(col, justify="left" if col == "figure" else "right")
    summary: dict[str, float] = {}
    for c in clients:
        rps, tps, cpu = (_median(cap[c], k) for k in ("requests_per_s", "tokens_per_s", "bench_cpu_util"))
        summary[f"{c}_requests_per_s"], summary[f"{c}_tokens_per_s"] = rps, tps
        t.add_row(f"{c}: requests/s (closed loop, {a.concurrency} streams)", f"{rps:,.0f}",
                  f">= {TARGETS['requests_per_s']:,.0f}", "yes" if rps >= TARGETS["requests_per_s"] else "no")
        t.add_row(f"{c}: streamed tokens/s (16 chunks per answer)", f"{tps:,.0f}",
                  f">= {TARGETS['tokens_per_s']:,.0f}", "yes" if tps >= TARGETS["tokens_per_s"] else "no")
        t.add_row(f"{c}: bench CPU (share of one core)", f"{cpu * 100:.0f}%", "", "")
    for key, label in (("chunk_error_ms_p50", "timing error per chunk, P50 (ms)"),
                       ("chunk_error_ms_p99", "timing error per chunk, P99 (ms)"),
                       ("first_token_error_ms_p50", "first-token timing error, P50 (ms)"),
                       ("first_token_error_ms_p99", "first-token timing error, P99 (ms)"),
                       ("send_lag_ms_p50", "send lag behind schedule, P50 (ms)"),
                       ("send_lag_ms_p99", "send lag behind schedule, P99 (ms)")):
        v = _median(tim, key)
        summary[key] = v
        is_err = key.startswith("chunk_error")
        t.add_row(label + f" at {a.timing_rate:g} req/s", f"{v:.3f}",
                  f"<= {TARGETS['timing_error_ms']:g}" if is_err else "",
                  ("yes" if v <= TARGETS["timing_error_ms"] else "no") if is_err else "")
    console.print(t)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    console.print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
                  f"{load[0]:.2f} at the end; {time.time() - t0:.0f} s in all")
    doc = {"benchmark": "bench_capacity", "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
           "cpus": os.cpu_count(), "loadavg_end": load, "repeats": a.repeats, "targets": TARGETS,
           "summary_medians": summary, "capacity_runs": cap, "timing_runs": tim,
           "notes": "timing error = bench read time of a chunk minus the fake server's write time of it (same "
                    "monotonic clock); capacity: zero-latency fake server, closed loop"}
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    console.print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
