"""The native kernels, product by product, on SmolLM2's own matrices: the layouts and the prefill crossover.

    .venv/bin/python benchmarks/native_kernels.py          # ~1 min; writes benchmarks/results/native_kernels.json

1. Single-row products (one decode token), every layer's four matrices and the LM head: the GGUF's Q4_1 blocks read
   as they are, against the same weights repacked at load (Q4_1R: nibbles together, scales as float32). Timed
   interleaved, minimum of the repeats (the machine is shared; the minimum is the kernel's own cost).
2. The crossover that NATIVE_GEMM_MIN_TOKENS encodes: for T tokens, the kernel reading blocks against dequantizing
   the weight once and running torch's sgemm.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tailguard.engine import kernels
from tailguard.engine.loader import load_gguf
from tailguard.engine.model_store import resolve_model_path


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "native_kernels.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = load_gguf(resolve_model_path("smollm2"), packed=True)  # layer matrices come repacked (Q4_1R)
    result: dict = {"threads": args.threads, "simd": kernels.simd(), "date": time.strftime("%Y-%m-%d %H:%M")}

    # 1. single-row products: Q4_1 as stored vs Q4_1R
    names = ("qkv", "o", "gate_up", "down")
    layouts = {"Q4_1R": {n: [getattr(lw, n) for lw in weights.layers] for n in names}}
    layouts["Q4_1"] = {n: [_unrepack(m) for m in mats] for n, mats in layouts["Q4_1R"].items()}
    totals: dict[str, dict[str, float]] = {k: {} for k in layouts}
    for name in names:
        x = torch.randn(1, layouts["Q4_1R"][name][0].in_features)
        for layout in ("Q4_1", "Q4_1R", "Q4_1", "Q4_1R"):  # interleaved
            mats = layouts[layout][name]
            t = best(lambda mats=mats, x=x: [kernels.linear(x, m) for m in mats], args.repeats)
            totals[layout][name] = min(totals[layout].get(name, t), t)
    xh = torch.randn(1, weights.lm_head.in_features)
    lm = best(lambda: kernels.linear(xh, weights.lm_head), args.repeats)
    print("single-row products, 30 layers each, ms (minimum of repeats):")
    print("| matrix | Q4_1 as stored | Q4_1R repacked | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for name in names:
        a, b = totals["Q4_1"][name], totals["Q4_1R"][name]
        print(f"| {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f}x |")
    sa, sb = sum(totals["Q4_1"].values()), sum(totals["Q4_1R"].values())
    print(f"| all layers | {sa * 1e3:.2f} | {sb * 1e3:.2f} | {sa / sb:.2f}x |")
    print(f"| LM head (Q8_0) | {lm * 1e3:.2f} | | |")
    result["single_row_ms"] = {k: {n: v * 1e3 for n, v in d.items()} for k, d in totals.items()}
    result["lm_head_ms"] = lm * 1e3

    # 2. the prefill crossover on gate_up (the largest matrix)
    w = weights.layers[0].gate_up
    rows = []
    print("\nkernel on blocks vs dequantize + sgemm, gate_up of one layer, ms:")
    print("| tokens | kernel | dequantize + sgemm |")
    print("| ---: | ---: | ---: |")
    for t in (4, 16, 32, 64, 128, 256):
        x = torch.randn(t, w.in_features)
        k = best(lambda x=x: kernels.linear(x, w), max(5, args.repeats // 3))
        g = best(lambda x=x: F.linear(x, w.dequantize()), max(5, args.repeats // 3))
        rows.append({"tokens": t, "kernel_ms": k * 1e3, "sgemm_ms": g * 1e3})
        print(f"| {t} | {k * 1e3:.3f} | {g * 1e3:.3f} |")
    result["crossover"] = rows
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")


def _unrepack(m: kernels.PackedMatrix) -> kernels.PackedMatrix:
    """Q4_1R back to the GGUF's Q4_1 blocks (for the comparison): halves of the float scales are exact."""
    n, nb = m.out_features, m.in_features // 32
    qs = m.data[:, : nb * 16].reshape(n, nb, 16)
    d = m.data[:, nb * 16 : nb * 20].contiguous().view(torch.float32).half().view(torch.uint8).view(n, nb, 2)
    mins = m.data[:, nb * 20 :].contiguous().view(torch.float32).half().view(torch.uint8).view(n, nb, 2)
    blocks = torch.cat([d, mins, qs], dim=2).reshape(n, nb * 20).contiguous()
    return kernels.PackedMatrix(blocks, kernels.Q4_1, n, m.in_features)


if __name__ == "__main__":
    main()
