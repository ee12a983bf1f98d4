#!/usr/bin/env python
"""Stream smoothing: the client's gaps between tokens against the lane's budget, and what holding tokens costs.

An engine that keeps up on average but delivers in bursts (a speculating engine's accepted guesses, a replica whose
steps batch several tokens, a gateway's upstream read that carries several chunks) gives its clients a stream of
stalls: K tokens at once, then a silence. A lane's ``pace_itl_s`` (the budget) with ``pace_reserve`` R holds up to R
tokens of a burst back and sends them one per budget into the silence after it. This script streams from
tailguard's server over a scripted engine with such bursts, ``--streams`` at a time, for each setting (no pacing, then
R = 1, 2, 4 at the budget), arms alternated over ``--rounds``, and reports from the client's side: the gap P99 and
the share of gaps over the budget; and what it costs: each token's extra wait at the server (the record's send time
minus production time) and the E2E.

    .venv/bin/python benchmarks/stream_smoothing.py          # ~1 min; writes benchmarks/results/stream_smoothing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tailguard.engine.events import TokenEvent
from tailguard.engine.fake import FakeEngine
from tailguard.engine.sequence import FinishReason, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "stream_smoothing.json"


class BurstyEngine(FakeEngine):
    """``burst`` tokens at once every ``period`` seconds: ``burst / period`` tokens/s on average."""

    def __init__(self, burst: int, period: float) -> None:
        super().__init__()
        self.burst, self.period = burst, period

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncGenerator[TokenEvent, None]:
        start = time.perf_counter()
        n = sampling.max_tokens
        for i in range(n):
            if i and i % self.burst == 0:
                await asyncio.sleep(self.period)
            yield TokenEvent(request_id, 65 + i % 26, chr(65 + i % 26), time.perf_counter())
        yield TokenEvent(request_id, None, "", time.perf_counter(), finished=True, finish_reason=FinishReason.LENGTH,
                         num_prompt_tokens=len(prompt_token_ids), num_output_tokens=n, arrival=arrival_time,
                         first_scheduled=start, first_token=start)


def stream(url: str, tokens: int) -> tuple[list[float], float, str]:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    times: list[float] = []
    t0 = time.perf_counter()
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])], time.perf_counter() - t0, rid


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument("--burst", type=int, default=4)
    p.add_argument("--period", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import ThreadedServer

    arms: dict[str, dict[str, Any]] = {"off": {}}
    for r in (1, 2, 4):
        arms[f"reserve {r}"] = {"pace_itl_s": args.budget, "pace_reserve": r}
    figures: dict[str, dict[str, list[float]]] = {a: {"gaps": [], "lag": [], "e2e": []} for a in arms}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.streams) as pool:
        for rnd in range(args.rounds):
            order = list(arms) if rnd % 2 == 0 else list(reversed(arms))
            for arm in order:
                cfg = ServerConfig(model="fake", port=0, store_path=str(Path(tmp) / f"{arm}-{rnd}.sqlite3"),
                                   access_log=False, log_level="warning",
                                   lanes={"standard": {"priority": 1, **arms[arm]}})
                with ThreadedServer(cfg, BurstyEngine(args.burst, args.period)) as srv:
                    got = list(pool.map(lambda _: stream(srv.url, args.tokens), range(args.streams)))
                    srv.state.store.flush()
                    for gaps, e2e, rid in got:
                        figures[arm]["gaps"] += gaps
                        figures[arm]["e2e"].append(e2e)
                        rec = srv.state.store.get(rid)
                        figures[arm]["lag"] += [s - m for s, m in zip(rec["token_sent"], rec["token_times"])]
                print(f"round {rnd + 1}/{args.rounds} {arm}: done", flush=True)

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))]

    rows = {}
    for arm, f in figures.items():
        rows[arm] = {"gap_p50_ms": pct(f["gaps"], 0.5) * 1e3, "gap_p99_ms": pct(f["gaps"], 0.99) * 1e3,
                     "over_budget_share": sum(g > args.budget * 1.05 for g in f["gaps"]) / len(f["gaps"]),
                     "lag_mean_ms": statistics.mean(f["lag"]) * 1e3, "lag_p99_ms": pct(f["lag"], 0.99) * 1e3,
                     "e2e_median_s": statistics.median(f["e2e"])}
    print(f"\nbudget {args.budget * 1e3:.0f} ms; engine: {args.burst} tokens every {args.period * 1e3:.0f} ms "
          f"({args.burst / args.period:.0f} tokens/s); {args.streams} streams x {args.rounds} rounds")
    print("| pacing | client gap P50 | client gap P99 | gaps over budget | held per token, mean / P99 | E2E median |")
    print("|---|---:|---:|---:|---:|---:|")
    for arm, r in rows.items():
        print(f"| {arm} | {r['gap_p50_ms']:.0f} ms | {r['gap_p99_ms']:.0f} ms | {r['over_budget_share']:.1%} | "
              f"{r['lag_mean_ms']:.0f} / {r['lag_p99_ms']:.0f} ms | {r['e2e_median_s']:.2f} s |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"benchmark": "stream_smoothing", "date": time.strftime("%Y-%m-%d"),
                                   "machine": platform.processor() or platform.machine(), "args": vars(args),
                                   "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
