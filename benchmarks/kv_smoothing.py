"""Would smoothing the keys' channels make the int8 KV cache faithful enough to be the default? Measured before
writing kernels for it.

    .venv/bin/python benchmarks/kv_smoothing.py          # ~8 min, 2 threads; benchmarks/results/kv_smoothing.json

The int8 KV cache (one scale per row of 64) costs +0.31% perplexity pooled, worse than llama.cpp's Q4_1, so it cannot
be the default; with it the server could hold 32 conversations of 2K tokens in 743 MiB instead of 1.41 GiB. Keys have
outlier channels (a few channels of a head carry most of its range, and one scale per row then rounds the others
coarsely); dividing each channel by a fixed factor s before rounding and multiplying the query by s instead is exact
in the attention score (q . k = (q * s) . (k / s)), the trick of SmoothQuant and QServe's SmoothAttention. This
measures how much of the loss that recovers, with everything else held still: float32 weights, a float32 KV cache,
and only the keys rounded to int8 rows (emulated: rounded, then stored as float32), after RoPE, per (layer, KV head,
channel) factors s = max|k|^alpha taken on a calibration text (the project's docs: not the held-out texts), the same
factor for both channels of a RoPE pair. Perplexity on the shipped held-out texts, teacher-forced, as
benchmarks/fidelity.py and benchmarks/kv_low_bit.py judge a format.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from kv_low_bit import PREFIX, text_perplexities, versus  # benchmarks/: the same texts, scored the same way

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.scoring import score_text

HERE = Path(__file__).parent
ROOT = HERE.parent


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Round to int8 with one scale per row (max |x| / 127, the scale rounded to float16 as the cache stores it)."""
    scale = (x.abs().amax(-1, keepdim=True) / 127.0).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return torch.round(x / scale).clamp(-127, 127) * scale


class KeyRounding:
    """Wraps the model's RoPE (which rotates Q and K heads together) to round the K heads it returns."""

    def __init__(self, model, layers: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
        self.model, self.rope = model, model._rope
        self.layers, self.q_heads = layers, q_heads
        self.calls = 0
        self.mode: str | None = None  # None: as is; "record": keep max |k| per channel; "rows"; "smooth"
        self.max_abs = torch.zeros(layers, kv_heads, head_dim)
        self.factors: torch.Tensor | None = None
        model._rope = self

    def __call__(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = self.rope(t, cos, sin)
        layer = self.calls % self.layers  # one call per layer, in order, every forward
        self.calls += 1
        if self.mode is None:
            return out
        k = out[:, self.q_heads:].float()
        if self.mode == "record":
            self.max_abs[layer] = torch.maximum(self.max_abs[layer], k.abs().amax(0))
            return out
        if self.mode == "rows":
            rounded = int8_rows(k)
        else:
            assert self.factors is not None
            rounded = int8_rows(k / self.factors[layer]) * self.factors[layer]
        out = out.clone()
        out[:, self.q_heads:] = rounded.to(out.dtype)
        return out

    def pair_max(self) -> torch.Tensor:
        """max |k| per channel, the larger of each RoPE pair (channels i and i + head_dim/2 rotate together)."""
        half = self.max_abs.shape[-1] // 2
        pair = torch.maximum(self.max_abs[..., :half], self.max_abs[..., half:])
        return torch.cat([pair, pair], -1).clamp_min(1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alphas", default="0.5,1.0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "kv_smoothing.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = LLMEngine(EngineArgs(model="smollm2", weight_format="float32", kv_cache_dtype="float32",
                                  kv_cache_tokens=4096, enable_prefix_caching=False))
    cfg = engine.model.config
    hook = KeyRounding(engine.model, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    hook.mode = "record"
    calibration = (ROOT / "docs" / "techniques.md").read_text()[:6000] + (ROOT / "README.md").read_text()[:3000]
    score_text(engine, engine.tokenizer.encode(calibration)[:1500], PREFIX)
    pair = hook.pair_max()
    outliers = float((pair.amax(-1) / pair.median(-1).values).mean())
    print(f"keys: a head's largest channel is {outliers:.1f}x its median channel (mean over layers and heads)")
    hook.mode = None
    base = text_perplexities(engine)
    print(f"float32 keys (reference): ppl en {base['en']:.4f} zh {base['zh']:.4f} both {base['both']:.4f}", flush=True)
    rows = []
    for name, alpha in [("int8 rows (today's int8 KV, keys only)", None)] + [
            (f"int8 rows of k / max|k|^{a}", float(a)) for a in args.alphas.split(",")]:
        hook.mode = "rows" if alpha is None else "smooth"
        hook.factors = None if alpha is None else pair ** alpha
        ppl = text_perplexities(engine)
        rows.append({"keys": name, "alpha": alpha, "perplexity": ppl, "vs_float32_pct": versus(ppl, base, name, 3)})
    print("\n| keys rounded as | ppl en vs float32 | zh | both |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        p = row["vs_float32_pct"]
        print(f"| {row['keys']} | {p['en']:+.3f}% | {p['zh']:+.3f}% | {p['both']:+.3f}% |")
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "key_outlier_ratio": outliers,
              "reference": base, "rows": rows, "wall_s": time.perf_counter() - started}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
