"""Why the int8 KV cache turns its rows by a Hadamard transform: perplexity, per-token change and top-1 agreement
against a float32 KV cache, with the rows stored as they are and turned.

    .venv/bin/python benchmarks/kv_rotation.py          # ~9 min, 2 threads; benchmarks/results/kv_rotation.json

One scale per (position, KV head) row of 64 is set by the row's largest value; SmolLM2's key heads have outlier
channels (the largest 3.6x the median, benchmarks/kv_smoothing.py), so the other channels round coarsely. Turning
each row by the orthonormal Hadamard transform H before rounding spreads every channel over the whole row (QuaRot's
trick): the row's values come out near-Gaussian and one scale fits them all. The scores need no correction
((Hq) . (Hk) = q . k, the queries turn too) and the attention output turns back (H is its own inverse). The
alternative at the same precision, two scales a row (groups of 32, emulated here), costs 2 bytes a row more.

Everything but the KV format is held still: float32 weights (the torch path, whose int8 rows are the numbers
tg_kernels.c writes), the shipped held-out texts scored teacher-forced as benchmarks/fidelity.py does.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from kv_low_bit import PREFIX, TEXTS  # benchmarks/: the same texts, scored the same way

from tailguard.engine import torch_model as model_module
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.scoring import TextScore, score_text

HERE = Path(__file__).parent


def groups_of_32(x: torch.Tensor) -> torch.Tensor:
    """Round to int8 with one float16 scale per 32 values (emulated: the result is then stored through the int8 path,
    whose own rounding of already-rounded values is nearly exact)."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // 32, 32)
    scale = (g.abs().amax(-1, keepdim=True) / 127.0).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.round(g / scale).clamp(-127, 127) * scale).reshape(shape)


VARIANTS = {  # name: (KV dtype, rows turned, emulated rounding before the store)
    "float32": ("float32", True, None),
    "float16": ("float16", True, None),
    "int8 rows as they are": ("int8", False, None),
    "int8, two scales a row (groups of 32)": ("int8", False, groups_of_32),
    "int8 rows turned by H (tailguard's int8 KV)": ("int8", True, None),
}


def scores(kv_dtype: str, rotated: bool, rounding) -> dict[str, TextScore]:
    rotates, store = model_module.rotates_kv, model_module.quantize_kv
    if not rotated:
        model_module.rotates_kv = lambda *_: False
    if rounding is not None:
        model_module.quantize_kv = lambda x: store(rounding(x))
    try:
        engine = LLMEngine(EngineArgs(model="smollm2", weight_format="float32", kv_cache_dtype=kv_dtype,
                                      kv_cache_tokens=4096, enable_prefix_caching=False))
        return {lang: score_text(engine, engine.tokenizer.encode(path.read_text(encoding="utf-8")), PREFIX)
                for lang, path in TEXTS.items()}
    finally:
        model_module.rotates_kv, model_module.quantize_kv = rotates, store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "kv_rotation.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = {name: scores(*spec) for name, spec in VARIANTS.items()}
    base = results["float32"]
    base_nll = np.concatenate([base[lang].nll for lang in TEXTS])
    rows = []
    for name, per_lang in results.items():
        row: dict = {"kv": name}
        for lang in TEXTS:
            sc, ref = per_lang[lang], base[lang]
            row[lang] = {"perplexity": sc.perplexity, "ppl_vs_float32_pct": 100 * (sc.perplexity / ref.perplexity - 1),
                         "mean_abs_nll_change": float(np.mean(np.abs(np.array(sc.nll) - np.array(ref.nll)))),
                         "top1_agreement": sc.top1_agreement(ref)}
        nll = np.concatenate([per_lang[lang].nll for lang in TEXTS])
        row["both"] = {"ppl_vs_float32_pct": 100 * (math.exp(nll.mean() - base_nll.mean()) - 1),
                       "mean_abs_nll_change": float(np.mean(np.abs(nll - base_nll)))}
        rows.append(row)
        print(f"{name}: ppl both {row['both']['ppl_vs_float32_pct']:+.3f}%, mean |change| "
              f"{row['both']['mean_abs_nll_change']:.4f}", flush=True)
    print("\n| KV rows | ppl en vs float32 | zh | both | mean per-token \\|change of -log p\\| en / zh "
          "| top-1 agreement en / zh |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        en, zh = row["en"], row["zh"]
        print(f"| {row['kv']} | {en['ppl_vs_float32_pct']:+.3f}% | {zh['ppl_vs_float32_pct']:+.3f}% "
              f"| {row['both']['ppl_vs_float32_pct']:+.3f}% | {en['mean_abs_nll_change']:.4f} / "
              f"{zh['mean_abs_nll_change']:.4f} | {100 * en['top1_agreement']:.1f}% / {100 * zh['top1_agreement']:.1f}% |")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "rows": rows,
              "wall_s": time.perf_counter() - started}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
