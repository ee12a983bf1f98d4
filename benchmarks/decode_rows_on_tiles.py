#!/usr/bin/env python
"""From how many rows would a product be faster on the matrix units than in the block kernels decode rows use?

    .venv/bin/python benchmarks/decode_rows_on_tiles.py      # ~2 min; writes benchmarks/results/decode_rows_on_tiles.json
    .venv/bin/python benchmarks/decode_rows_on_tiles.py results/decode_rows_on_tiles_epyc.json   # another machine's

Decode rows go through the block kernels (the GGUF's Q4_1/Q8_0 blocks, int8 activations in two passes) at any batch
size, so that a row's numbers never depend on how many others share its step; prompt rows go through bfloat16 tiles
(AMX). For T rows of one product at SmolLM2's shapes (one layer's qkv, gate_up and down), this times both paths with
the kernels' 2 threads, alternating, median of 15, and prints the ratio: below 1 the tiles win. Then the engine as
a whole with ``--decode-rows-on-tiles`` off and at 8: requests served per second when 160 chat-sized requests
(prompts of 100-160 tokens, 29 tokens each) arrive at once, the two engines alternating, median of 3; and how many of
16 greedy answers of 64 tokens come out the same. The tiles are AMX's, or
the kernels' software tile unit on a CPU with AVX-512 BF16 and no AMX (``kernels.tile_unit``); a CPU with neither
prints nothing to compare. The one argument names the result file, relative to benchmarks/.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.loader import load_gguf
from tailguard.engine.model_store import resolve_model_path
from tailguard.engine.sequence import SamplingParams

OUT = Path(__file__).parent / "results" / "decode_rows_on_tiles.json"
ROWS = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    if not kernels.amx_available():
        print("no AMX tiles on this CPU: nothing to compare")
        return 0
    layer = load_gguf(resolve_model_path("smollm2"), packed=True).layers[3]
    rng = np.random.default_rng(0)
    load_start = os.getloadavg()[0]
    rows = []
    print(f"{'rows':>4}  {'product':8}  {'blocks ms':>9}  {'tiles ms':>8}  tiles / blocks")
    for name in ("qkv", "gate_up", "down"):
        m = getattr(layer, name)
        tiles = kernels.pack_bf16(m)
        for t in ROWS:
            x = rng.standard_normal((t, m.in_features)).astype(np.float32)
            blocks, tiled = [], []
            for _ in range(15):
                s = time.perf_counter()
                kernels.linear(x, m)
                blocks.append(time.perf_counter() - s)
                s = time.perf_counter()
                kernels.linear_bf16(x, tiles, m.out_features)
                tiled.append(time.perf_counter() - s)
            b, a = statistics.median(blocks) * 1e3, statistics.median(tiled) * 1e3
            rows.append({"product": name, "rows": t, "blocks_ms": round(b, 4), "tiles_ms": round(a, 4),
                         "ratio": round(a / b, 3)})
            print(f"{t:4d}  {name:8}  {b:9.3f}  {a:8.3f}  {a / b:.2f}x")
    engine = saturation()
    out = Path(__file__).parent / sys.argv[1] if len(sys.argv) > 1 else OUT
    out.write_text(json.dumps({
        "benchmark": "decode_rows_on_tiles", "date": datetime.date.today().isoformat(),
        "threads": kernels.num_threads(), "tile_unit": kernels.tile_unit(),
        "load_average": [load_start, os.getloadavg()[0]], "rows": rows,
        "engine": engine,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def saturation() -> dict:
    """Requests/s with every request queued at once, and greedy agreement, off vs 8 rows (see the docstring)."""
    engines = {n: LLMEngine(EngineArgs(model="smollm2", num_threads=2, decode_rows_on_tiles=n)) for n in (0, 8)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=int(rng.integers(100, 161))).tolist() for _ in range(160)]
    short = SamplingParams(max_tokens=29, temperature=0, ignore_eos=True)
    for eng in engines.values():
        eng.generate(prompts[:8], short)  # warm-up
    rates: dict[int, list[float]] = {n: [] for n in engines}
    for _ in range(3):
        for n, eng in engines.items():
            start = time.perf_counter()
            eng.generate(prompts, short)
            rates[n].append(len(prompts) / (time.perf_counter() - start))
    tok = engines[0].tokenizer
    chats = [tok.encode_chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
             for i in range(16)]
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    answers = {n: eng.generate(chats, greedy) for n, eng in engines.items()}
    same = sum(a == b for a, b in zip(answers[0], answers[8], strict=True))
    off, on = statistics.median(rates[0]), statistics.median(rates[8])
    print(f"160 requests at once: {off:.1f} req/s with --decode-rows-on-tiles 0, {on:.1f} req/s at 8 (the default) "
          f"({on / off:.2f}x); 16 greedy answers of 64 tokens alike: {same}")
    return {"requests_per_s": {"off": rates[0], "rows_8": rates[8]}, "median_ratio": round(on / off, 3),
            "greedy_answers_alike_of_16": same}


if __name__ == "__main__":
    raise SystemExit(main())
