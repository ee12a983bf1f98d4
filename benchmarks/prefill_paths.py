"""TTFT of one prompt, native weights: prefill chunks as rows of the C step vs the whole step in torch, same process.

    .venv/bin/python benchmarks/prefill_paths.py                       # ~3 min; results/prefill_paths.json
    .venv/bin/python benchmarks/prefill_paths.py --lengths 512,2048 --repeats 3

Modes alternate per length (``c`` first). ``c`` is the engine's default: prefill chunks are C rows while they end within
``ModelRunner.native_prefill_max_context`` positions, and torch beyond (``--c-limit`` changes it; a large value runs
every chunk in C). ``torch`` turns the one-call C step off for the run (decodes too, which a max_tokens=1 request does
not have). Prefix caching is off, so every repeat prefills the whole prompt; chunks of 256 in a 512-token budget.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--c-limit", type=int, default=None, help="native_prefill_max_context for the c mode")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_paths.json"))
    args = ap.parse_args()

    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import SamplingParams

    engine = LLMEngine(EngineArgs(model="smollm2", num_threads=int(os.environ["OMP_NUM_THREADS"]),
                                  enable_prefix_caching=False, kv_cache_dtype="float16", runner="torch"))
    model, runner = engine.runner.model, engine.runner
    if args.c_limit is not None:
        runner.native_prefill_max_context = args.c_limit
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'prompt':>7} | {'TTFT c':>8} | {'TTFT torch':>10} | torch / c", flush=True)
    for length in (int(x) for x in args.lengths.split(",")):
        ids = rng.integers(100, 40000, size=length).tolist()
        times: dict[str, list[float]] = {"c": [], "torch": []}
        for _ in range(args.repeats):
            for mode in ("c", "torch"):
                model._native_step_fits = mode == "c"
                t0 = time.perf_counter()
                engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
                times[mode].append(time.perf_counter() - t0)
        model._native_step_fits = True
        c, t = statistics.median(times["c"]), statistics.median(times["torch"])
        rows.append({"prompt_tokens": length, "ttft_c_s": c, "ttft_torch_s": t, "runs": times})
        print(f"{length:>7} | {c:>7.3f}s | {t:>9.3f}s | {t / c:.2f}x", flush=True)
    out = {"benchmark": "prefill_paths", "threads": int(os.environ["OMP_NUM_THREADS"]),
           "native_prefill_max_context": runner.native_prefill_max_context, "rows": rows,
           "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
