"""What the SLO monitor costs: per request on the request path, per window query, per evaluation.

- request path: what ``ServerState.close_record`` adds (``SLOMonitor.record`` of a finished Timeline: one deque
  append), and the two per-request questions the endpoint asks before admission (``shed_for``,
  ``degradation_for``). Target: <= 5 us per request. Applying a queued request to its window cell (its sample, the
  ITL gaps, counts) happens in the evaluation thread; its cost per request is reported too.
- window query: ``SlidingWindows.query`` over the 15-minute window (30 slots of 30 s) at a steady load spread
  over several keys, merging the t-digests of four metrics; once after the ring turned (cold: closed slots merged
  afresh) and then again within the same slot (warm: closed slots cached). Target: <= 5 ms.
- evaluation: one ``SLOMonitor.evaluate`` (tiers, baseline + advanced profiles, advisories, hotspots, long-context
  and region views) on the same windows. It runs in a worker thread every few seconds, off the event loop.

    python benchmarks/monitor_cost.py            # ~1 minute
    python benchmarks/monitor_cost.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path

from tailguard.observe.timeline import Outcome, Timeline
from tailguard.slo.config import MonitorConfig
from tailguard.slo.monitor import SLOMonitor
from tailguard.slo.profiles import Selector

ROOT = Path(__file__).resolve().parent


def _timeline(rng: random.Random, i: int, tokens: int, bt: str, region: str) -> Timeline:
    t0 = 1000.0
    tl = Timeline(request_id=f"r{i}", endpoint="/v1/chat/completions", received=t0, business_type=bt,
                  region=region, stream=True)
    tl.tokenized = t0 + 0.001
    tl.scheduled = t0 + 0.001 + rng.expovariate(1 / 0.05)
    first = tl.scheduled + 0.05
    gaps = [rng.uniform(0.02, 0.04) for _ in range(tokens - 1)]
    times = [first]
    for g in gaps:
        times.append(times[-1] + g)
    tl.first_token, tl.last_token = first, times[-1]
    tl.token_times = times
    tl.token_sent = [t + 0.0001 for t in times]
    tl.num_prompt_tokens, tl.num_output_tokens = rng.choice((200, 2000, 12000)), tokens
    tl.finalize(200, Outcome.SUCCESS, at=times[-1] + 0.0002)
    tl.summary()  # the server's metrics computed it already when the monitor sees the record
    return tl


def _per_call_us(fn, items: list, repeat: int) -> list[float]:
    """Per-call microseconds of ``fn(item)`` over ``items``, one figure per repetition."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        out.append((time.perf_counter() - t0) / len(items) * 1e6)
    return out


def _loop_ns() -> float:
    """Nanoseconds per iteration of a trivial Python loop: how fast this interpreter runs right now (a loaded
    or slow machine inflates every figure below by the same factor)."""
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i * 2
        best = min(best, (time.perf_counter() - t0) / 200_000 * 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rps", type=float, default=100.0, help="steady load for the window figures")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request (ITL gaps recorded)")
    ap.add_argument("--output", default=str(ROOT / "results" / "monitor_cost.json"))
    args = ap.parse_args()
    loop_ns = _loop_ns()
    rng = random.Random(0)
    bts, regions = ("chat", "batch", "finance", "medical"), ("cn-east", "cn-north", "eu")
    pool = [_timeline(rng, i, args.tokens, rng.choice(bts), rng.choice(regions)) for i in range(2000)]
    clock = [1_800_000_000.0]
    cfg = MonitorConfig(profiles=["baseline", "advanced"], peak={"mode": "never"})
    mon = SLOMonitor(cfg, clock=lambda: clock[0])

    # 1) Request path.
    n = 20_000 if args.quick else 200_000
    items = [pool[i % len(pool)] for i in range(n)]
    record_us, apply_us = [], []
    for _ in range(3 if args.quick else 5):
        record_us += _per_call_us(mon.record, items, 1)
        t0 = time.perf_counter()
        assert mon.windows.drain() == n
        apply_us.append((time.perf_counter() - t0) / n * 1e6)
    mon.evaluate()  # no tier is active: the questions take their fast path, as they do almost always
    ask = [(tl.business_type, tl.lane, tl.client, tl.region, tl.num_prompt_tokens) for tl in items]
    ask_us = _per_call_us(lambda a: (mon.shed_for(a[0], a[1]), mon.degradation_for(*a)), ask, 3)

    # 2) Windows at a steady load: 15 minutes of 30-second slots.
    mon = SLOMonitor(cfg, clock=lambda: clock[0])
    per_slot = int(args.rps * cfg.slot_s)
    slots = int(cfg.offpeak_window_s / cfg.slot_s)
    for s in range(slots):
        base = clock[0]
        for j in range(per_slot):
            mon.record(pool[(s * per_slot + j) % len(pool)], now=base + j * cfg.slot_s / per_slot)
        clock[0] += cfg.slot_s
    w = mon.windows
    mon.evaluate()  # apply what the fill queued
    cold, warm, evals = [], [], []
    for _ in range(3 if args.quick else 10):
        clock[0] += cfg.slot_s  # the ring turns: closed-slot merges are no longer cached
        for j in range(per_slot):  # a full slot of new traffic: the window stays at a steady 15 minutes
            mon.record(pool[j % len(pool)], now=clock[0] - cfg.slot_s + j * cfg.slot_s / per_slot)
        w.advance(clock[0])  # apply the queue and turn the ring (the evaluation thread's job, timed above)
        t0 = time.perf_counter()
        st = w.query(Selector(), cfg.offpeak_window_s, now=clock[0])
        cold.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        w.query(Selector(), cfg.offpeak_window_s, now=clock[0])
        warm.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        mon.evaluate()
        evals.append((time.perf_counter() - t0) * 1e3)
    slice_t0 = time.perf_counter()
    w.query(Selector(business_types=("finance",)), cfg.offpeak_window_s, now=clock[0])
    slice_ms = (time.perf_counter() - slice_t0) * 1e3

    res = {
        "platform": {"python": platform.python_version(), "machine": platform.machine(),
                     "processor": platform.processor() or platform.machine()},
        "config": {"tokens_per_request": args.tokens, "rps": args.rps, "slot_s": cfg.slot_s,
                   "window_s": cfg.offpeak_window_s, "keys": len(w.known_keys()),
                   "requests_in_window": st.total, "itl_values_in_window": st.n("itl")},
        "python_loop_iteration_ns": loop_ns,
        "record_us": {"median": statistics.median(record_us), "max": max(record_us), "runs": record_us},
        "apply_us": {"median": statistics.median(apply_us), "runs": apply_us},
        "questions_us": {"median": statistics.median(ask_us), "runs": ask_us},
        "request_path_us": statistics.median(record_us) + statistics.median(ask_us),
        "query_cold_ms": {"median": statistics.median(cold), "max": max(cold)},
        "query_warm_ms": {"median": statistics.median(warm), "max": max(warm)},
        "query_one_business_type_ms": slice_ms,
        "evaluate_ms": {"median": statistics.median(evals), "max": max(evals)},
        "targets": {"request_path_us": 5.0, "query_ms": 5.0},
    }
    rows = [
        ("request path: record a finished request", f"{res['record_us']['median']:.2f} us",
         "queued: one deque append"),
        ("request path: shed + degrade questions", f"{res['questions_us']['median']:.2f} us", "no tier active"),
        ("request path: total", f"{res['request_path_us']:.2f} us", "target <= 5 us"),
        ("evaluation thread: apply a queued request", f"{res['apply_us']['median']:.2f} us",
         f"{args.tokens} tokens ({args.tokens - 1} ITL gaps); off the request path"),
        ("window query, 15 min, after the ring turned", f"{res['query_cold_ms']['median']:.2f} ms",
         f"max {res['query_cold_ms']['max']:.2f} ms; target <= 5 ms"),
        ("window query, 15 min, same slot (cached)", f"{res['query_warm_ms']['median']:.2f} ms", ""),
        ("window query, a new slice (one business type)", f"{slice_ms:.2f} ms",
         "first query of a key set builds its 30 slot aggregates"),
        ("evaluation (off the event loop)", f"{res['evaluate_ms']['median']:.1f} ms",
         f"max {res['evaluate_ms']['max']:.1f} ms"),
    ]
    print(f"(a trivial Python loop iteration takes {loop_ns:.0f} ns on this machine now)")
    print(f"SLO monitor cost: {st.total:,} requests and {st.n('itl'):,} ITL gaps in a "
          f"{cfg.offpeak_window_s:g} s window ({args.rps:g} req/s, {len(w.known_keys())} keys, "
          f"{slots} slots of {cfg.slot_s:g} s)")
    width = max(len(r[0]) for r in rows)
    print(f"| {'what':<{width}} | {'median':>9} | note")
    print(f"|{'-' * (width + 2)}|{'-' * 11}|------")
    for what, val, note in rows:
        print(f"| {what:<{width}} | {val:>9} | {note}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
