"""One prompt's C step with two builds of the kernels in one process: the same engine, the library swapped between
alternating prompts, so a noisy host slows both alike and the paired ratios show the change.

    git show a8bc588:src/tailguard/engine/kernels/tg_kernels.c > /tmp/before.c
    .venv/bin/python benchmarks/prompt_ab.py /tmp/before.c          # ~2 min; writes benchmarks/results/prompt_ab.json

For each prompt length: TTFT of one prompt (max_tokens 1, one chunk, no prefix cache) and one phase of the C step
(--phase: attention, rope + KV write, norms, o ... as benchmarks/profile_native_step.py names them), before and after
alternating (the order flipped every pair), medians and the median of the paired ratios.
Both builds share the engine's packed weights, so the two sources must agree on the library's ABI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

OUT = Path(__file__).parent / "results" / "prompt_ab.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, help="the other build's tg_kernels.c")
    ap.add_argument("--lengths", default="512,1536")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--phase", default="attention", choices=kernels.PROFILE_PHASES)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    libs = {"before": kernels.load_build(args.before), "after": kernels.lib()}
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = LLMEngine(EngineArgs(model="smollm2", enable_prefix_caching=False, num_threads=args.threads,
                                  max_num_batched_tokens=max(lengths), max_prefill_chunk=max(lengths)))
    one = SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'prompt':>6} | {'before':>16} | {'after':>16} | after / before (paired): TTFT, {args.phase}", flush=True)
    for n in lengths:
        ids = rng.integers(100, 40000, size=n).tolist()
        for lib in libs.values():  # warm both
            kernels._lib = lib
            engine.generate([ids], one)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
        for p in range(args.pairs):
            for name in ("before", "after") if p % 2 == 0 else ("after", "before"):
                kernels._lib = libs[name]
                kernels.profile_decode(True)
                t = time.perf_counter()
                engine.generate([ids], one)
                t = time.perf_counter() - t
                phase = kernels.profile_read()[args.phase]
                kernels.profile_decode(False)
                runs[name].append((t, phase))
        ttft = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        phase = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
        r_ttft = statistics.median(a[0] / b[0] for a, b in zip(runs["after"], runs["before"], strict=True))
        r_phase = statistics.median(a[1] / b[1] for a, b in zip(runs["after"], runs["before"], strict=True))
        rows.append({"prompt_tokens": n, "ttft_s": ttft, "phase_s": phase, "paired_ratio_ttft": r_ttft,
                     "paired_ratio_phase": r_phase, "runs": runs})
        print(f"{n:>6} | {ttft['before'] * 1e3:>5.0f} ms ({phase['before'] * 1e3:>5.1f}) | "
              f"{ttft['after'] * 1e3:>5.0f} ms ({phase['after'] * 1e3:>5.1f}) | {r_ttft:.3f}x, {r_phase:.3f}x", flush=True)
    kernels._lib = libs["after"]
    out = {"benchmark": "prompt_ab", "date": datetime.date.today().isoformat(), "before": str(args.before),
           "phase": args.phase, "threads": args.threads, "pairs": args.pairs, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
