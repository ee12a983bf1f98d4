"""The prompt rows' products on the matrix units (AMX, bfloat16 tiles) alone: tg_linear_bf16 at SmolLM2's shapes.

    .venv/bin/python benchmarks/tile_product.py          # ~1 min; writes benchmarks/results/tile_product.json
    git show HEAD:src/tailguard/engine/kernels/tg_kernels.c > /tmp/base.c
    .venv/bin/python benchmarks/tile_product.py --baseline-source /tmp/base.c   # against another build, same run

For T = 512 and 1,536 rows and each product of a layer (qkv K=576 N=960, o K=576 N=576, gate_up K=576 N=3,072,
down K=1,536 N=576): GFLOP/s of the whole call (activations rounded to bfloat16 tiles, the tile products, y written,
as the C step runs them except the MLP, whose step fuses gate_up with SiLU and down's input tiles) with 1 and 2
threads of the kernels' pool, and torch's bfloat16 F.linear on the same shapes for scale (its input is bfloat16
already and its output bfloat16: less to read and write). The weight's tiles are pack_bf16's array, as the engine
holds them. Timed interleaved (the builds alternate within each repeat), median of --repeats: the machine is shared.
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

HERE = Path(__file__).parent
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # name: (K, N)


def libraries(baseline: str | None) -> dict:
    """{"new": this tree's kernels} and, given a source file, {"base": its build} (one process, two libraries)."""
    from tailguard.engine import kernels

    out = {"base": kernels.load_build(Path(baseline))} if baseline else {}
    out["new"] = kernels.lib()
    return out


def timed(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1536])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--baseline-source", default=None, help="a tg_kernels.c to build and time beside this tree's")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results" / "tile_product.json"))
    args = ap.parse_args()
    from tailguard.engine import kernels

    libs = libraries(args.baseline_source)  # before anything else loads the library
    if not kernels.amx_available():
        raise SystemExit("this CPU (or OS) offers no AMX tiles: nothing to measure")
    torch = F = None
    if not args.no_torch:
        import torch
        import torch.nn.functional as F
    rng = np.random.default_rng(0)
    weights = {}
    for name, (k, n) in SHAPES.items():
        dense = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        weights[name] = (dense, kernels.pack_bf16(kernels.PackedMatrix(dense.view(np.uint8), kernels.F32, n, k)))
    rows = []
    load_before = os.getloadavg()
    cols = [f"{v} {t}t" for t in args.threads for v in libs]
    print(f"{'T':>5} {'product':>8} | " + " | ".join(f"{c:>9}" for c in cols) + " | torch " +
          "/".join(f"{t}t" for t in args.threads) + "  (GFLOP/s)")
    for T in args.rows:
        x = rng.standard_normal((T, 1536)).astype(np.float32)
        for name, (k, n) in SHAPES.items():
            tiles = weights[name][1]
            xs = np.ascontiguousarray(x[:, :k])
            y = np.zeros((T, n), dtype=np.float32)
            flop = 2.0 * T * k * n
            inner = max(1, int(4e8 // flop))
            times: dict[str, list[float]] = {}
            for threads in args.threads:
                for lib in libs.values():
                    lib.tg_set_num_threads(threads)
                for r in range(args.repeats + 1):
                    for v, lib in libs.items():
                        def call(lib=lib, xs=xs, tiles=tiles, y=y, T=T, k=k, n=n):
                            assert lib.tg_linear_bf16(xs.ctypes.data, T, k, tiles.ctypes.data, n, y.ctypes.data, 0) == 0

                        t = timed(call, inner)
                        if r > 0:  # the first round warms
                            times.setdefault(f"{v}_{threads}t", []).append(t)
            gflops = {key: flop / statistics.median(ts) / 1e9 for key, ts in times.items()}
            if torch is not None:
                xt, wt = torch.from_numpy(xs).bfloat16(), torch.from_numpy(weights[name][0]).bfloat16()
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    ts = [timed(lambda xt=xt, wt=wt: F.linear(xt, wt), inner) for _ in range(args.repeats + 1)][1:]
                    gflops[f"torch_{threads}t"] = flop / statistics.median(ts) / 1e9
            rows.append({"T": T, "product": name, "K": k, "N": n, "gflops": gflops,
                         "ms": {key: statistics.median(ts) * 1e3 for key, ts in times.items()}})
            cells = " | ".join(f"{gflops[f'{v}_{t}t']:>9.0f}" for t in args.threads for v in libs)
            tcell = "/".join(f"{gflops[f'torch_{t}t']:.0f}" for t in args.threads) if torch is not None else "-"
            print(f"{T:>5} {name:>8} | {cells} | {tcell}", flush=True)
    out = {"benchmark": "tile_product", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "repeats": args.repeats, "baseline_source": args.baseline_source,
           "torch": torch.__version__ if torch is not None else None, "load_before": load_before,
           "load_after": os.getloadavg(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"load average before {load_before}, after {out['load_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
