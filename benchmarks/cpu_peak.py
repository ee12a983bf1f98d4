"""What this CPU's vector units can multiply at most: the ceiling the prompt path's products are judged against.

    .venv/bin/python benchmarks/cpu_peak.py          # ~20 s; writes benchmarks/results/cpu_peak.json

Compiles a small C program with the machine's gcc (-O3 -march=native, as the kernels are built) that runs, on 1 and
on all of the kernels' threads, 16 independent chains of one instruction on registers only (no memory traffic):
float32 FMA (VFMADD, 2 flops a lane), bfloat16 pair dot products (VDPBF16PS, 4 flops a lane) and int8 quad dot
products (VPDPBUSD, 8 ops a lane), and prints operations a second. A CPU without AVX-512 BF16 or VNNI prints only
what it has. Median of --repeats; read it beside benchmarks/tile_product.py's GFLOP/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).parent / "results" / "cpu_peak.json"

PROGRAM = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

/* argv: kind (fma, bf16, int8), threads, iterations; prints ops/s */
int main(int argc, char **argv) {
    const char kind = argv[1][0];
    const int threads = atoi(argv[2]);
    const long iters = atol(argv[3]);
    float sink = 0.0f;
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps(0.0f);
        const __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3f81);
        for (long i = 0; i < iters; i++) {
            for (int j = 0; j < 16; j++) {
                if (kind == 'f') acc[j] = _mm512_fmadd_ps(acc[j], (__m512)a, (__m512)b);
#if defined(__AVX512BF16__)
                else if (kind == 'b') acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)b);
#endif
#if defined(__AVX512VNNI__)
                else if (kind == 'i') acc[j] = (__m512)_mm512_dpbusd_epi32((__m512i)acc[j], a, b);
#endif
            }
        }
        for (int i = 0; i < 16; i++) sink += _mm512_reduce_add_ps(acc[i]);
    }
    const double dt = now() - t0;
    const double per = kind == 'f' ? 32.0 : kind == 'b' ? 64.0 : 128.0; /* ops per instruction */
    printf("%.6g %g\n", (double)iters * 16 * threads * per / dt, (double)sink);
    return 0;
}
"""

KINDS = {"fma": "float32 FMA", "bf16": "bfloat16 dot (VDPBF16PS)", "int8": "int8 dot (VPDPBUSD)"}
NEEDS = {"fma": "avx512f", "bf16": "avx512_bf16", "int8": "avx512_vnni"}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=30_000_000, help="loop trips of 16 instructions per thread")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    flags = cpu_flags()
    kinds = [k for k in KINDS if NEEDS[k] in flags]
    if not kinds:
        raise SystemExit("this CPU has no AVX-512: nothing to measure")
    threads = sorted({1, len(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(PROGRAM)
        subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        rows = []
        print(f"{'instruction':<26} | " + " | ".join(f"{t} thread(s) Gop/s" for t in threads), flush=True)
        for kind in kinds:
            medians = {}
            for t in threads:
                runs = [float(subprocess.run([str(exe), kind, str(t), str(args.iterations)], check=True,
                                             capture_output=True, text=True).stdout.split()[0])
                        for _ in range(args.repeats)]
                medians[t] = statistics.median(runs) / 1e9
            rows.append({"kind": kind, "instruction": KINDS[kind], "gops": {str(t): v for t, v in medians.items()}})
            print(f"{KINDS[kind]:<26} | " + " | ".join(f"{medians[t]:>18.0f}" for t in threads), flush=True)
    out = {"benchmark": "cpu_peak", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "repeats": args.repeats, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
