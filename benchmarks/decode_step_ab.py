#!/usr/bin/env python
"""Decode steps with two builds of the kernels in one process: the same engine and sequences, the library swapped
window by window, so a noisy host slows both alike and the paired ratios show the change.

    git show HEAD:src/tailguard/engine/kernels/tg_kernels.c > /tmp/before.c
    .venv/bin/python benchmarks/decode_step_ab.py /tmp/before.c      # ~2 min; writes results/decode_step_ab.json

For each shape (streams x context tokens): the streams are prefilled, then 12 pairs of windows of 6 decode steps
alternate the builds (the order flipped every pair; a window's first step is untimed). Reported: each build's median
step time, the attention phase's (``kernels.profile_decode``), and the median of the paired ratios. Both builds share
the engine's weights and KV cache, so the two sources must agree on the library's ABI.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

OUT = Path(__file__).parent / "results" / "decode_step_ab.json"


def timed_window(engine: LLMEngine, steps: int) -> tuple[float, float]:
    """Seconds per step and per step's attention phase over ``steps`` decode steps."""
    engine.step()  # a window's first step pays the switch
    kernels.profile_decode(True)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    t = (time.perf_counter() - t) / steps
    attention = kernels.profile_read()["attention"] / steps
    kernels.profile_decode(False)
    return t, attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path, help="the other build's tg_kernels.c")
    ap.add_argument("--shapes", default="1x2048,16x128,16x1024,32x512,64x256", help="STREAMSxCONTEXT, comma-separated")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    libs = {"before": kernels.load_build(args.before), "after": kernels.lib()}
    engine = LLMEngine(EngineArgs(model="smollm2", enable_prefix_caching=False))
    rows = []
    print(f"{'shape':>8} | {'before: step (attention)':>24} | {'after: step (attention)':>24} | after / before (paired)",
          flush=True)
    for shape in args.shapes.split(","):
        streams, context = (int(x) for x in shape.split("x"))
        sp = SamplingParams(max_tokens=args.pairs * 2 * (args.steps + 1) + 8, temperature=0, ignore_eos=True)
        ids = [engine.add_request([(i * 131 + j * 7) % 40000 + 100 for j in range(context)], sp)
               for i in range(streams)]
        while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()  # prefill until every stream decodes
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
        for p in range(args.pairs):
            for name in ("before", "after") if p % 2 == 0 else ("after", "before"):
                kernels._lib = libs[name]
                runs[name].append(timed_window(engine, args.steps))
        for rid in ids:
            engine.abort(rid)
        engine.step()
        step = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
        attn = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
        r_step = statistics.median(a[0] / b[0] for a, b in zip(runs["after"], runs["before"], strict=True))
        r_attn = statistics.median(a[1] / b[1] for a, b in zip(runs["after"], runs["before"], strict=True))
        rows.append({"streams": streams, "context": context, "step_s": step, "attention_s": attn,
                     "paired_ratio_step": r_step, "paired_ratio_attention": r_attn, "runs": runs})
        print(f"{shape:>8} | {step['before'] * 1e3:>9.1f} ms ({attn['before'] * 1e3:>5.1f} ms) | "
              f"{step['after'] * 1e3:>9.1f} ms ({attn['after'] * 1e3:>5.1f} ms) | {r_step:.3f}x, attention "
              f"{r_attn:.3f}x", flush=True)
    kernels._lib = libs["after"]
    out = {"benchmark": "decode_step_ab", "date": datetime.date.today().isoformat(), "before": str(args.before),
           "pairs": args.pairs, "steps": args.steps, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
