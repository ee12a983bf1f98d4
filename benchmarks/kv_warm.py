"""Page faults in a prompt's step, and what warming the KV cache ahead of demand saves, same process.

    .venv/bin/python benchmarks/kv_warm.py            # ~1 min; writes benchmarks/results/kv_warm.json

The KV cache is anonymous memory that becomes resident as blocks are first written, so a prompt that lands on blocks
never used before takes a page fault every 4 KiB of its K/V. An idle server writes the next never-used blocks ahead of
demand (LLMEngine.warm_kv); this compares two engines in one process, prefix caching on as the server runs it, fresh
prompts alternating between them (the order flipped every pair): one warmed before each prompt as an idle server
warms, one never. Reported: TTFT (max_tokens 1) and minor page faults per prompt, medians, and the median of the paired
ratios; and the cost of one fault on this machine (first writes to fresh anonymous pages).
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import resource
import statistics
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "results" / "kv_warm.json"


def fault_cost_s(pages: int = 2304, repeats: int = 21) -> float:
    """Median seconds of one minor fault: the first write to each page of a fresh anonymous mapping."""
    page = mmap.PAGESIZE
    times = []
    for _ in range(repeats):
        m = mmap.mmap(-1, pages * page)
        a = np.frombuffer(m, dtype=np.uint8)
        t = time.perf_counter()
        a[::page] = 1
        times.append((time.perf_counter() - t) / pages)
        del a
        m.close()
    return statistics.median(times)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,1536")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import SamplingParams

    engines = {mode: LLMEngine(EngineArgs(model="smollm2", num_threads=args.threads)) for mode in ("cold", "warm")}
    one = SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.default_rng(0)
    cost = fault_cost_s()
    print(f"one page fault: {cost * 1e6:.2f} us", flush=True)
    rows = []
    print(f"{'prompt':>6} | {'cold: TTFT, faults':>20} | {'warm: TTFT, faults':>20} | warm / cold (paired)", flush=True)
    for n in (int(x) for x in args.lengths.split(",")):
        runs: dict[str, list[tuple[float, int]]] = {mode: [] for mode in engines}
        for p in range(args.pairs + 1):  # the first pair warms both up
            for mode in ("cold", "warm") if p % 2 == 0 else ("warm", "cold"):
                engine = engines[mode]
                if mode == "warm":
                    while engine.warm_kv():
                        pass
                ids = rng.integers(100, 40000, size=n).tolist()
                f0, t = minor_faults(), time.perf_counter()
                engine.generate([ids], one)
                t, faults = time.perf_counter() - t, minor_faults() - f0
                if p > 0:
                    runs[mode].append((t, faults))
        ttft = {m: statistics.median(r[0] for r in v) for m, v in runs.items()}
        faults = {m: statistics.median(r[1] for r in v) for m, v in runs.items()}
        ratio = statistics.median(w[0] / c[0] for w, c in zip(runs["warm"], runs["cold"], strict=True))
        rows.append({"prompt_tokens": n, "ttft_s": ttft, "minor_faults": faults, "paired_ratio_ttft": ratio,
                     "runs": runs})
        print(f"{n:>6} | {ttft['cold'] * 1e3:>8.0f} ms, {faults['cold']:>6.0f} | {ttft['warm'] * 1e3:>8.0f} ms, "
              f"{faults['warm']:>6.0f} | {ratio:.3f}x", flush=True)
    out = {"benchmark": "kv_warm", "date": datetime.date.today().isoformat(), "threads": args.threads,
           "pairs": args.pairs, "fault_cost_s": cost, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
