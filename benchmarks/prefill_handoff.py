"""TTFT of one long prompt on the default native runner: chunks past 2,048 positions handed to torch (the rule while
prompt rows went through the block kernels) against every chunk in the C step, where prompt rows are on bfloat16
tiles (the default where the CPU has AMX or AVX-512 BF16). Same engine, the two settings alternating.

    .venv/bin/python benchmarks/prefill_handoff.py                 # ~3 min; results/prefill_handoff.json
    .venv/bin/python benchmarks/prefill_handoff.py --lengths 3000 --repeats 3

Prefix caching off, chunks of 512 (the default), max_tokens 1; both settings give the same first token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import numpy as np

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.kv_layout import NATIVE_PREFILL_MAX_CONTEXT
from tailguard.engine.sequence import SamplingParams

OUT = Path(__file__).parent / "results" / "prefill_handoff.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="3000,6000")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    engine = LLMEngine(EngineArgs(model="smollm2", num_threads=2, enable_prefix_caching=False,
                                  step_time_budget_s=None))
    runner = engine.runner
    if not getattr(runner._step, "prompt_bf16", False):
        raise SystemExit("prompt rows are not on bfloat16 tiles here (no AMX or AVX-512 BF16, or "
                         "TAILGUARD_PROMPT_BF16=0): the hand-off rule is the one that applies")
    settings = {"handed off past 2,048": NATIVE_PREFILL_MAX_CONTEXT, "all in C": runner.native_prefill_max_context}
    one = SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'prompt':>6} | " + " | ".join(f"{k:>22}" for k in settings) + " | ratio | same token")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = rng.integers(100, 40000, size=n).tolist()
        times: dict[str, list[float]] = {k: [] for k in settings}
        first: dict[str, int] = {}
        for r in range(args.repeats):
            for name in (list(settings) if r % 2 == 0 else list(settings)[::-1]):
                runner.native_prefill_max_context = settings[name]
                t = time.perf_counter()
                first[name] = engine.generate([ids], one)[0][0]
                times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        a, b = med.values()
        same = len(set(first.values())) == 1
        rows.append({"prompt_tokens": n, "seconds": times, "median_s": med, "ratio": b / a, "same_first_token": same})
        print(f"{n:>6} | " + " | ".join(f"{v:>20.2f} s" for v in med.values()) + f" | {b / a:.2f}x | {same}",
              flush=True)
    runner.native_prefill_max_context = settings["all in C"]
    args.out.write_text(json.dumps({"benchmark": "prefill_handoff", "date": datetime.datetime.now().isoformat(),
                                    "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
