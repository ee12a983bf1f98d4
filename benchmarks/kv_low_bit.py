"""Would a 4-bit KV cache keep float32's answers? Perplexity of emulated low-bit K/V formats against float32.

    .venv/bin/python benchmarks/kv_low_bit.py            # ~10 min, 2 threads; benchmarks/results/kv_low_bit.json
    .venv/bin/python benchmarks/kv_low_bit.py --variants asym32,k8_vasym32

Issue 8's memory target (the server under 1 GB with 32 conversations of 2K tokens held) is out of reach with the
int8 KV cache (720 MiB for 65,536 tokens, beside torch's 218 MiB): only a smaller cache could close it. Before
writing kernels for one, this measures what it would cost in fidelity, the way benchmarks/fidelity.py judges a
format: per-token perplexity on the shipped held-out texts (English and Chinese, teacher-forced) against float32
weights and a float32 KV cache.

The low-bit formats are emulated, not stored: every K and V row the engine writes is rounded to the 4-bit grid
(``fake quantization``) and then stored through the int8 KV path, whose own rounding (+0.3% measured alone, the
``int8`` row) is far finer than a 4-bit step. Weights stay float32 so that only the KV format moves the figure.
Variants: symmetric (max |x| / 7, 15 levels) or asymmetric (min and step, 16 levels) scales over groups of 64 (one
head row) or 32 values; and int8 keys with 4-bit values (keys carry the outlier channels).
Bytes per (position, head) row for head_dim 64: int8 66; sym64 34; sym32 36; asym64 36; asym32 40; k8 + v asym32
53 on average (66 and 40).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tailguard.engine import torch_model as model_module
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.scoring import score_text

HERE = Path(__file__).parent
TEXTS = {"en": HERE / "data" / "heldout_en.txt", "zh": HERE / "data" / "heldout_zh.txt"}
PREFIX = 16
ROW_BYTES = {"int8": 66, "sym64": 34, "sym32": 36, "asym64": 36, "asym32": 40, "k8_vsym32": 51, "k8_vasym32": 53}


def fake_symmetric(x: torch.Tensor, group: int) -> torch.Tensor:
    """Round to 15 levels, -7..7 times max |x| / 7 over each group (the scale rounded to float16, as stored)."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    step = (g.abs().amax(-1, keepdim=True) / 7.0).half().float()
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round(g / step).clamp(-7, 7) * step).reshape(shape)


def fake_asymmetric(x: torch.Tensor, group: int) -> torch.Tensor:
    """Round to 16 levels between each group's min and max (min and step stored as float16: llama.cpp's Q4_1)."""
    shape = x.shape
    g = x.float().reshape(*shape[:-1], shape[-1] // group, group)
    lo = g.amin(-1, keepdim=True).half().float()
    step = ((g.amax(-1, keepdim=True) - lo) / 15.0).half().float()
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round((g - lo) / step).clamp(0, 15) * step + lo).reshape(shape)


Rounding = Callable[[torch.Tensor], torch.Tensor] | None
VARIANTS: dict[str, tuple[Rounding, Rounding]] = {  # (keys, values); None: the int8 path alone
    "int8": (None, None),
    "sym64": (lambda x: fake_symmetric(x, 64), lambda x: fake_symmetric(x, 64)),
    "sym32": (lambda x: fake_symmetric(x, 32), lambda x: fake_symmetric(x, 32)),
    "asym64": (lambda x: fake_asymmetric(x, 64), lambda x: fake_asymmetric(x, 64)),
    "asym32": (lambda x: fake_asymmetric(x, 32), lambda x: fake_asymmetric(x, 32)),
    "k8_vsym32": (None, lambda x: fake_symmetric(x, 32)),
    "k8_vasym32": (None, lambda x: fake_asymmetric(x, 32)),
}


def text_perplexities(engine: LLMEngine) -> dict[str, float]:
    """Teacher-forced perplexity on each shipped held-out text and on both pooled."""
    out, nll_all = {}, []
    for lang, path in TEXTS.items():
        nll = score_text(engine, engine.tokenizer.encode(path.read_text(encoding="utf-8")), PREFIX).nll
        out[lang] = math.exp(sum(nll) / len(nll))
        nll_all += nll
    out["both"] = math.exp(sum(nll_all) / len(nll_all))
    return out


def versus(ppl: dict[str, float], base: dict[str, float], label: str, digits: int = 2) -> dict[str, float]:
    """Each perplexity's change against the reference in percent, printed on one line after ``label``."""
    pct = {k: 100.0 * (ppl[k] / base[k] - 1.0) for k in ppl}
    print(f"{label}: " + ", ".join(f"{k} {v:+.{digits}f}%" for k, v in pct.items()), flush=True)
    return pct


def pooled_perplexity(kv_dtype: str, keys: Rounding = None, values: Rounding = None) -> dict[str, float]:
    """Perplexity per text and pooled, float32 weights, with K and V rounded by ``keys`` / ``values`` as written."""
    store = model_module.quantize_kv
    written = [0]

    def rounded_store(x: torch.Tensor) -> torch.Tensor:
        # The forward quantizes K, then V, of each layer (model.forward: ``quantize_kv(k), quantize_kv(v)``).
        fn = keys if written[0] % 2 == 0 else values
        written[0] += 1
        return store(fn(x) if fn is not None else x)

    model_module.quantize_kv = rounded_store
    rotates = model_module.rotates_kv
    model_module.rotates_kv = lambda *_: False  # measured before int8 rows were turned: the rounding of plain rows
    try:
        engine = LLMEngine(EngineArgs(model="smollm2", weight_format="float32", kv_cache_dtype=kv_dtype,
                                      kv_cache_tokens=4096, enable_prefix_caching=False))
        return text_perplexities(engine)
    finally:
        model_module.quantize_kv, model_module.rotates_kv = store, rotates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "kv_low_bit.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    base = pooled_perplexity("float32")
    print(f"float32 KV (reference): ppl en {base['en']:.4f} zh {base['zh']:.4f} both {base['both']:.4f}", flush=True)
    rows = []
    for name in args.variants.split(","):
        keys, values = VARIANTS[name]
        ppl = pooled_perplexity("int8", keys, values)
        rows.append({"variant": name, "row_bytes": ROW_BYTES[name], "perplexity": ppl,
                     "vs_float32_pct": versus(ppl, base, name)})
    print("\n| K/V format | bytes a row | KV for 32 x 2K | ppl en vs float32 | zh | both |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        mib = row["row_bytes"] * 2 * 3 * 30 * 32 * 2048 / 2**20  # K and V, 3 KV heads, 30 layers (SmolLM2-135M)
        p = row["vs_float32_pct"]
        print(f"| {row['variant']} | {row['row_bytes']} | {mib:,.0f} MiB | {p['en']:+.2f}% | {p['zh']:+.2f}% "
              f"| {p['both']:+.2f}% |")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "reference": base, "variants": rows,
              "wall_s": time.perf_counter() - started}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
