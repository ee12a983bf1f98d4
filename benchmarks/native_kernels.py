"""The native kernels, product by product, on SmolLM2's own matrices: float32 against int8 activations, and the
prefill crossover.

    .venv/bin/python benchmarks/native_kernels.py          # ~1-2 min; writes benchmarks/results/native_kernels.json

1. Every layer's four matrices and the LM head at T = 1, 16 and 64 activation rows, in the two layouts the loader
   can produce: float32 activations (Q4_1R layers, the GGUF's Q8_0 head; TAILGUARD_INT8_ACTIVATIONS=0) and int8
   activations (Q4_1X / Q8_0X, AVX-512 VNNI), with their int8 residual (2 passes, the default) and alone. Timed interleaved, minimum of the repeats (the machine is shared; the
   minimum is the kernel's own cost).
2. The crossover that model.py's NATIVE_GEMM_MIN_TOKENS encodes: for T tokens, the kernel reading blocks (in the
   layout the loader picks here) against dequantizing the weight once and running torch's sgemm.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tailguard.engine import kernels
from tailguard.engine.loader import load_gguf
from tailguard.engine.model_store import resolve_model_path

NAMES = ("qkv", "o", "gate_up", "down")


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def load(int8: bool):
    """SmolLM2's packed weights in the layout for float32 (``int8=False``) or int8 activations."""
    saved = os.environ.get(kernels.INT8_ACTIVATIONS_ENV)
    os.environ[kernels.INT8_ACTIVATIONS_ENV] = str(kernels.DEFAULT_ACTIVATION_PASSES) if int8 else "0"
    try:
        return load_gguf(resolve_model_path("smollm2"), packed=True)
    finally:
        if saved is None:
            del os.environ[kernels.INT8_ACTIVATIONS_ENV]
        else:
            os.environ[kernels.INT8_ACTIVATIONS_ENV] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "native_kernels.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"threads": args.threads, "simd": kernels.simd(), "date": time.strftime("%Y-%m-%d %H:%M")}
    layouts = {"float32 act": load(False)}
    passes = {"float32 act": 2, "int8 act": 2, "int8 1-pass": 1}  # (the float32 layout ignores it)
    if kernels.lib().tg_int8_dot():
        layouts["int8 act"] = load(True)
        layouts["int8 1-pass"] = layouts["int8 act"]
    else:
        print("this build has no AVX-512 VNNI: only the float32-activation layout is measured")
    fmts = {name: {n: kernels.NATIVE_FORMATS[getattr(w.layers[0], n).fmt] for n in NAMES} | {
        "LM head": kernels.NATIVE_FORMATS[w.lm_head.fmt]} for name, w in layouts.items()}
    result["formats"] = fmts

    # 1. products per matrix, all 30 layers (the LM head once), float32 vs int8 activations
    result["products_ms"] = {}
    for t in (1, 16, 64):
        totals: dict[str, dict[str, float]] = {k: {} for k in layouts}
        for name in (*NAMES, "LM head"):
            for _ in range(2):  # interleaved
                for layout, w in layouts.items():
                    if w.lm_head.fmt in kernels.INTERLEAVED_FORMATS:
                        kernels.set_activation_passes(passes[layout])
                    mats = [w.lm_head] if name == "LM head" else [getattr(lw, name) for lw in w.layers]
                    x = torch.randn(t, mats[0].in_features)
                    took = best(lambda mats=mats, x=x: [kernels.linear(x, m) for m in mats], args.repeats)
                    totals[layout][name] = min(totals[layout].get(name, took), took)
        print(f"\nT = {t}: 30 layers (LM head once), ms, minimum of {args.repeats}:")
        print("| matrix | " + " | ".join(f"{k} ({'/'.join(sorted(set(fmts[k].values())))})" for k in layouts)
              + " | speed-up |")
        print("| --- |" + " ---: |" * (len(layouts) + 1))
        for name in (*NAMES, "LM head"):
            cells = [f"{totals[k][name] * 1e3:.2f}" for k in layouts]
            ratio = totals["float32 act"][name] / totals["int8 act"][name] if "int8 act" in totals else float("nan")
            print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
        sums = {k: sum(v.values()) for k, v in totals.items()}
        ratio = sums["float32 act"] / sums["int8 act"] if "int8 act" in sums else float("nan")
        print("| all | " + " | ".join(f"{v * 1e3:.2f}" for v in sums.values()) + f" | {ratio:.2f}x |")
        result["products_ms"][str(t)] = {k: {n: v * 1e3 for n, v in d.items()} for k, d in totals.items()}

    # 2. the prefill crossover on gate_up (the largest layer matrix), for each layout
    rows = []
    print("\nkernel on blocks vs dequantize + sgemm, gate_up of one layer, ms:")
    print("| tokens | " + " | ".join(f"kernel, {k}" for k in layouts) + " | dequantize + sgemm |")
    print("| ---: |" + " ---: |" * (len(layouts) + 1))
    for t in (16, 64, 128, 192, 256, 384, 512):
        x = torch.randn(t, layouts["float32 act"].layers[0].gate_up.in_features)
        row: dict = {"tokens": t}
        for layout, w in layouts.items():
            m = w.layers[0].gate_up
            if m.fmt in kernels.INTERLEAVED_FORMATS:
                kernels.set_activation_passes(passes[layout])
            row[f"kernel_ms {layout}"] = best(lambda x=x, m=m: kernels.linear(x, m), max(5, args.repeats // 3)) * 1e3
        m = layouts["float32 act"].layers[0].gate_up
        row["sgemm_ms"] = best(lambda x=x, m=m: F.linear(x, m.dequantize()), max(5, args.repeats // 3)) * 1e3
        rows.append(row)
        print(f"| {t} | " + " | ".join(f"{row[f'kernel_ms {k}']:.3f}" for k in layouts) + f" | {row['sgemm_ms']:.3f} |")
    result["crossover"] = rows
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
