"""How many request records per second the store sustains, and what ``put`` costs on the request path, for the
PostgreSQL and the SQLite backends, from one process (issue 13: >= 2,000 records/s into PostgreSQL, with the
request-path cost unchanged).

Per backend:
- drain rate: N records put as fast as the caller can, then ``flush``: records / (last commit - first put). The
  writer thread's ceiling (rows built, redaction off, batches of up to 512 committed).
- paced run: records put at a fixed rate (default 2,000/s) for a fixed time, as a gateway would; the rate holds if
  the backlog stays small and the last record is committed shortly after the last put. Each ``put`` is timed
  (time.perf_counter around the call): its P50/P99 is the request-path cost, the same code for both backends
  (an enqueue), measured while the writer is busy beside it.

Records look like a streamed chat answer: 64 output tokens (per-token times in the record's JSON), 2 threads in all
(the caller and the writer). PostgreSQL: a throwaway server started here (initdb, fsync on), or ``--pg-url``.

    python benchmarks/store_throughput.py            # ~1 minute
    python benchmarks/store_throughput.py --quick    # a smoke run (results to a temporary file)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tailguard.observe.stores import open_store
from tailguard.observe.timeline import Outcome, Timeline

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))  # tests/pg_cluster.py: the throwaway PostgreSQL server


def _timeline(i: int, tokens: int = 64) -> Timeline:
    t0 = time.perf_counter()
    times = [t0 + 0.05 + 0.02 * k for k in range(tokens)]
    tl = Timeline(request_id=f"bench-{i}", endpoint="/v1/chat/completions", received=t0, received_unix=time.time(),
                  tokenized=t0 + 0.001, scheduled=t0 + 0.002, first_token=times[0], last_token=times[-1],
                  token_times=times, token_sent=[t + 0.0001 for t in times], num_prompt_tokens=200,
                  num_output_tokens=tokens, finish_reason="stop", stream=True, user=f"user-{i % 50}",
                  business_type="chat")
    tl.finalize(200, Outcome.SUCCESS, at=times[-1] + 0.0002)
    return tl


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def drain_rate(target: str, n: int) -> dict:
    records = [_timeline(i) for i in range(n)]
    store = open_store(target, secret="bench", retention_days=36500)
    try:
        t0 = time.perf_counter()
        for tl in records:
            store.put(tl)
        put_done = time.perf_counter()
        assert store.flush(600), "the store did not drain"
        t1 = time.perf_counter()
        assert store.written == n and store.dropped == 0 and store.failed == 0, (store.written, store.dropped)
    finally:
        store.close()
    return {"records": n, "seconds": t1 - t0, "records_per_s": n / (t1 - t0), "put_all_s": put_done - t0}


def paced(target: str, rate: float, seconds: float) -> dict:
    n = int(rate * seconds)
    records = [_timeline(i) for i in range(n)]
    store = open_store(target, secret="bench", retention_days=36500)
    put_us: list[float] = []
    backlog_max = 0
    try:
        start = time.perf_counter()
        for i, tl in enumerate(records):
            due = start + i / rate
            while (now := time.perf_counter()) < due:
                if due - now > 0.002:
                    time.sleep(due - now - 0.001)
            t = time.perf_counter()
            store.put(tl)
            put_us.append((time.perf_counter() - t) * 1e6)
            if i % 100 == 0:
                backlog_max = max(backlog_max, store.backlog)
        last_put = time.perf_counter()
        assert store.flush(600), "the store did not drain"
        drained = time.perf_counter()
        assert store.written == n and store.dropped == 0 and store.failed == 0
    finally:
        store.close()
    offered = n / (last_put - start)
    return {"records": n, "offered_per_s": offered, "achieved_per_s": n / (drained - start),
            "drain_after_last_put_ms": (drained - last_put) * 1e3, "backlog_max": backlog_max,
            "put_us_p50": _pct(put_us, 0.50), "put_us_p99": _pct(put_us, 0.99), "put_us_max": max(put_us),
            "put_us_mean": statistics.fmean(put_us)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (its results go to a temporary file)")
    ap.add_argument("--pg-url", default=None, help="an existing PostgreSQL database (default: a throwaway server)")
    ap.add_argument("--drain-records", type=int, default=20_000,
                    help="drain run: records put at once (the backlog holds about 26,000 of these)")
    ap.add_argument("--rate", type=float, default=2000.0, help="paced run: records per second")
    ap.add_argument("--seconds", type=float, default=15.0, help="paced run: duration")
    ap.add_argument("--output", default=str(ROOT / "results" / "store_throughput.json"))
    args = ap.parse_args()
    if args.quick:
        args.drain_records, args.seconds = 3000, 2.0
        args.output = str(Path(tempfile.mkdtemp()) / "store_throughput.json")

    cluster = None
    pg_url = args.pg_url
    if pg_url is None:
        from tests.pg_cluster import PgCluster

        cluster = PgCluster(fsync=True)
        pg_ctx = cluster.database()
        pg_url = pg_ctx.__enter__()
    tmp = Path(tempfile.mkdtemp(prefix="tailguard-store-bench-"))
    results: dict = {}
    try:
        for name, target in (("postgresql", pg_url), ("sqlite", str(tmp / "requests.sqlite3"))):
            drain = drain_rate(target, args.drain_records)
            pace = paced(target, args.rate, args.seconds)
            results[name] = {"drain": drain, "paced": pace}
            print(f"{name}: drain {drain['records_per_s']:,.0f} rec/s; paced {pace['achieved_per_s']:,.0f} rec/s, "
                  f"put P50/P99 {pace['put_us_p50']:.1f}/{pace['put_us_p99']:.1f} us", flush=True)
    finally:
        if cluster is not None:
            pg_ctx.__exit__(None, None, None)
            cluster.destroy()

    rows = [("drain rate (records/s, writer's ceiling)", "drain", "records_per_s", "{:,.0f}"),
            (f"paced at {args.rate:,.0f}/s: offered (records/s)", "paced", "offered_per_s", "{:,.0f}"),
            ("paced: committed, first put to last commit (records/s)", "paced", "achieved_per_s", "{:,.0f}"),
            ("paced: last commit after the last put (ms)", "paced", "drain_after_last_put_ms", "{:.0f}"),
            ("paced: largest backlog (records)", "paced", "backlog_max", "{:,}"),
            ("request path: put P50 (us)", "paced", "put_us_p50", "{:.2f}"),
            ("request path: put P99 (us)", "paced", "put_us_p99", "{:.2f}"),
            ("request path: put max (us)", "paced", "put_us_max", "{:.0f}")]
    table = ["| what | PostgreSQL | SQLite |", "| --- | ---: | ---: |"]
    for label, part, key, fmt in rows:
        table.append(f"| {label} | {fmt.format(results['postgresql'][part][key])} | "
                     f"{fmt.format(results['sqlite'][part][key])} |")
    print("\n".join(table))
    pg = results["postgresql"]
    # Sustained: the offered rate committed, the backlog never more than a second of records, drained at the end.
    target_met = (args.rate >= 2000 and pg["paced"]["achieved_per_s"] >= 0.97 * args.rate
                  and pg["paced"]["backlog_max"] <= args.rate and pg["drain"]["records_per_s"] >= 2000)
    out = {"results": results, "rate": args.rate, "seconds": args.seconds, "drain_records": args.drain_records,
           "target_records_per_s": 2000, "target_met": target_met, "pg_server": "external" if args.pg_url else
           "throwaway (initdb, fsync on)", "python": platform.python_version(), "machine": platform.machine(),
           "load_average": list(os.getloadavg()), "table": table}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
