"""Fidelity of each weight format: perplexity and teacher-forced top-1 agreement against float32, same text, same run.

    .venv/bin/python benchmarks/fidelity.py            # ~2 min; writes benchmarks/results/fidelity.json

The texts (benchmarks/data/heldout_en.txt, heldout_zh.txt) were written for this benchmark, so no model saw them in
training. Every system scores the same token ids (tailguard's tokenizer): tailguard's formats through the engine's
own paths (a 16-token prefill, then one decode step per token, so the native format's decode kernel is what is
measured; with AVX-512 VNNI "native" takes int8 activations with their int8 residual (TAILGUARD_INT8_ACTIVATIONS=2,
the default), "native+int8act" int8 alone (=1), "native+f32act" float32 activations (=0));
llama.cpp's Q4_1 pipeline (llama-cpp-python, when installed) by evaluating the same ids with logits for
every position, as its llama-perplexity tool does. A format may be the default only if its perplexity is within 1% of
float32's and no worse than llama.cpp's Q4_1. Beside each perplexity change: the mean per-token |change of -log p|
(how far each prediction moved, which signed perplexity lets cancel) and a 95% interval of the pooled change from a
paired block bootstrap (blocks of 32 consecutive tokens, resampled 2,000 times): the resolution of these texts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.model_store import resolve_model_path
from tailguard.engine.scoring import TextScore, score_text

HERE = Path(__file__).parent
TEXTS = {"en": HERE / "data" / "heldout_en.txt", "zh": HERE / "data" / "heldout_zh.txt"}
PREFIX = 16
REFERENCE = "float32:float32"  # float32 weights and a float32 KV cache
Q4_1 = "llama.cpp Q4_1"
ACTIVATIONS = {"+int8act": "1", "+f32act": "0"}  # suffixes of a native weight format: TAILGUARD_INT8_ACTIVATIONS


def llama_cpp_score(path: str, ids: list[int], threads: int) -> TextScore | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_threads=threads, n_ctx=2048, n_batch=512, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    nll, top1 = [], []
    for pos in range(PREFIX - 1, len(ids) - 1):
        row = logits[pos]
        top = row.max()
        logz = top + math.log(np.exp(row - top).sum())
        nll.append(logz - row[ids[pos + 1]])
        top1.append(int(row.argmax()))
    return TextScore(nll, top1, ids[PREFIX:])


def bootstrap_interval(nll: np.ndarray, base: np.ndarray, block: int = 32, rounds: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled perplexity change (percent) from a paired block bootstrap over the tokens."""
    diff = nll - base
    n_blocks = len(diff) // block
    sums = diff[: n_blocks * block].reshape(n_blocks, block).sum(axis=1)
    picks = np.random.default_rng(seed).integers(0, n_blocks, size=(rounds, n_blocks))
    change = 100.0 * np.expm1(sums[picks].sum(axis=1) / (n_blocks * block))
    return float(np.percentile(change, 2.5)), float(np.percentile(change, 97.5))


def _pooled(per_lang: dict[str, TextScore]) -> float:
    """Perplexity over every scored token of both texts."""
    nll = [x for sc in per_lang.values() for x in sc.nll]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="float32:float32,native:int8,native:float16,native:float32,"
                        "native+int8act:float32,native+f32act:float32,bfloat16:float16,int8:float16",
                        help="weight format:KV cache dtype pairs; float32:float32 is the reference; native+int8act / "
                        "native+f32act: native with int8 / float32 activations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "fidelity.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    if REFERENCE not in formats:
        formats.insert(0, REFERENCE)
    results: dict = {"texts": {}, "date": time.strftime("%Y-%m-%d"), "machine": platform.processor(),
                     "threads": args.threads, "torch": torch.__version__}
    scores: dict[str, dict[str, TextScore]] = {}
    tokenizer = None
    for fmt in formats:
        weight_format, kv_dtype = fmt.split(":")
        suffix = next((k for k in ACTIVATIONS if weight_format.endswith(k)), "")
        os.environ[kernels.INT8_ACTIVATIONS_ENV] = ACTIVATIONS.get(suffix, str(kernels.DEFAULT_ACTIVATION_PASSES))
        engine = LLMEngine(EngineArgs(model="smollm2", weight_format=weight_format.removesuffix(suffix),
                                      kv_cache_dtype=kv_dtype, kv_cache_tokens=4096))
        if engine.weight_format == "native":
            layer = engine.model.layers[0]
            mats = ([layer.qkv, layer.o, layer.gate_up, layer.down] if engine.native
                    else [m.packed for m in layer if hasattr(m, "packed")])
            layouts = sorted({kernels.NATIVE_FORMATS[m.fmt] for m in mats})
            print(f"{fmt}: layer matrices {'/'.join(layouts)}", flush=True)
        tokenizer = engine.tokenizer
        for lang, path in TEXTS.items():
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
            start = time.perf_counter()
            scores.setdefault(fmt, {})[lang] = score_text(engine, ids, PREFIX)
            print(f"{fmt:9s} {lang}: {len(ids)} tokens, ppl {scores[fmt][lang].perplexity:.4f} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
        del engine
    model_path = str(resolve_model_path("smollm2"))
    for lang, path in TEXTS.items():
        ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        results["texts"][lang] = {"file": str(path.relative_to(HERE.parent)), "tokens": len(ids), "scored": len(ids) - PREFIX}
        ref = llama_cpp_score(model_path, ids, args.threads)
        if ref is not None:
            scores.setdefault(Q4_1, {})[lang] = ref
            print(f"llama.cpp {lang}: ppl {ref.perplexity:.4f}", flush=True)
    base = scores[REFERENCE]
    rows = []
    for name, per_lang in scores.items():
        row = {"system": name}
        for lang, sc in per_lang.items():
            row[lang] = {
                "perplexity": sc.perplexity,
                "ppl_vs_float32_pct": 100.0 * (sc.perplexity / base[lang].perplexity - 1.0),
                "top1_agreement_vs_float32": sc.top1_agreement(base[lang]),
                "mean_abs_nll_diff": float(np.mean(np.abs(np.array(sc.nll) - np.array(base[lang].nll)))),
            }
        rows.append(row)
    results["systems"] = rows
    print()
    print("| weights:KV cache | ppl en | vs float32 | top-1 agree en | ppl zh | vs float32 | top-1 agree zh |"
          " ppl both | vs float32 | 95% interval | mean \\|change of -log p\\| en / zh |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base_all = np.concatenate([np.array(base[lang].nll) for lang in TEXTS])
    for row in rows:
        cells = []
        for lang in TEXTS:
            r = row.get(lang)
            cells += [f"{r['perplexity']:.3f}", f"{r['ppl_vs_float32_pct']:+.3f}%",
                      f"{100 * r['top1_agreement_vs_float32']:.1f}%"] if r else ["", "", ""]
        both = _pooled(scores[row["system"]])
        row["both"] = {"perplexity": both, "ppl_vs_float32_pct": 100.0 * (both / _pooled(base) - 1.0)}
        nll_all = np.concatenate([np.array(scores[row["system"]][lang].nll) for lang in TEXTS])
        lo, hi = bootstrap_interval(nll_all, base_all)
        row["both"]["ppl_vs_float32_pct_interval95"] = [lo, hi]
        if Q4_1 in scores:  # the same tokens scored by llama.cpp: is this system's perplexity above Q4_1's?
            q4 = np.concatenate([np.array(scores[Q4_1][lang].nll) for lang in TEXTS])
            row["both"]["ppl_vs_q4_1_pct"] = 100.0 * math.expm1(float((nll_all - q4).mean()))
            row["both"]["ppl_vs_q4_1_pct_interval95"] = list(bootstrap_interval(nll_all, q4))
        cells += [f"{both:.3f}", f"{row['both']['ppl_vs_float32_pct']:+.3f}%", f"{lo:+.3f}% .. {hi:+.3f}%",
                  " / ".join(f"{row[lang]['mean_abs_nll_diff']:.4f}" for lang in TEXTS)]
        print(f"| {row['system']} | " + " | ".join(cells) + " |")
    if Q4_1 in scores:
        print(f"\nPooled perplexity against {Q4_1}'s on the same tokens (paired block bootstrap, 95%):")
        for row in rows:
            if row["system"] != Q4_1:
                lo, hi = row["both"]["ppl_vs_q4_1_pct_interval95"]
                print(f"  {row['system']}: {row['both']['ppl_vs_q4_1_pct']:+.3f}% [{lo:+.3f}% .. {hi:+.3f}%]")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
