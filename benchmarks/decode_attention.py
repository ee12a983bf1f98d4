"""Decode attention: the AVX-512 path (16 positions scored at a time) against the generic one, same process.

    .venv/bin/python benchmarks/decode_attention.py          # ~3 min, 2 threads; benchmarks/results/decode_attention.json

SmolLM2-135M, native weights, float16 KV (the default until 2026-12-04) and int8 KV (the default since). For each
shape (streams x context), the engine
decodes steady steps with every sequence in the batch; the two paths alternate window by window
(``kernels.set_generic_attention``), so the machine's drift hits both alike. Reported: median step time per path,
their ratio, and tokens/s. Greedy tokens of the two paths are compared as well (they must agree: same numbers up to
float32 summation order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

HERE = Path(__file__).parent
SHAPES = [(1, 1024), (1, 4096), (16, 256), (16, 2048), (64, 256)]


def steady_steps(engine: LLMEngine, streams: int, context: int, windows: int, steps: int) -> dict:
    """Prefill ``streams`` prompts of ``context`` tokens, then time decode windows, alternating the paths."""
    sp = SamplingParams(max_tokens=512, temperature=0, ignore_eos=True)
    for i in range(streams):
        prompt = [(i * 131 + j * 7) % 40000 + 100 for j in range(context)]
        engine.add_request(prompt, sp, request_id=f"s{i}")
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()  # prefill until every sequence decodes
    times: dict[str, list[float]] = {"fast": [], "generic": []}
    for w in range(2 * windows):
        path = "fast" if w % 2 == 0 else "generic"
        kernels.set_generic_attention(path == "generic")
        engine.step()  # the first step of a window pays any switch
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        times[path].append((time.perf_counter() - t0) / steps)
    kernels.set_generic_attention(False)
    for i in range(streams):
        engine.abort(f"s{i}")
    engine.step()
    fast, generic = statistics.median(times["fast"]), statistics.median(times["generic"])
    return {"streams": streams, "context": context, "fast_step_ms": 1e3 * fast, "generic_step_ms": 1e3 * generic,
            "speedup": generic / fast, "fast_tokens_per_s": streams / fast, "generic_tokens_per_s": streams / generic}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtypes", default="float16,int8")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", default=str(HERE / "results" / "decode_attention.json"))
    args = parser.parse_args()
    if kernels.simd() != "avx512":
        raise SystemExit("the fast attention path needs an AVX-512 build of the kernels")
    rows = []
    for kv in args.kv_dtypes.split(","):
        engine = LLMEngine(EngineArgs(model="smollm2", num_threads=args.threads, kv_cache_dtype=kv,
                                      kv_cache_tokens=80_000, max_num_seqs=64, max_num_batched_tokens=4096,
                                      enable_prefix_caching=False))
        engine.generate([[100 + j for j in range(64)]], SamplingParams(max_tokens=16, temperature=0))  # warm-up
        for streams, context in SHAPES:
            row = {"kv_cache": kv, **steady_steps(engine, streams, context, args.windows, args.steps)}
            rows.append(row)
            print(f"{kv:8s} {streams:3d} x {context:5d}: fast {row['fast_step_ms']:7.2f} ms, generic "
                  f"{row['generic_step_ms']:7.2f} ms a step: {row['speedup']:.2f}x", flush=True)
        del engine
    print("\n| KV cache | streams x context | step, fast | step, generic | fast vs generic | tokens/s fast |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['kv_cache']} | {r['streams']} x {r['context']} | {r['fast_step_ms']:.2f} ms | "
              f"{r['generic_step_ms']:.2f} ms | {r['speedup']:.2f}x | {r['fast_tokens_per_s']:.0f} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                                             "simd": kernels.simd(), "rows": rows}, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
