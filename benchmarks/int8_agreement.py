#!/usr/bin/env python
"""Why the int8 weight format changes greedy answers, and what SmoothQuant-style smoothing recovers.

Each variant runs the same 6 prompts (Chinese and English) for 24 greedy tokens (``ignore_eos``) on SmolLM2 and is
compared, position by position, with the float32 engine:

* ``int8 (fbgemm dynamic)``: the engine's int8 format: per-channel int8 weights, activations quantized per tensor
  at run time (7-bit, ``reduce_range``);
* ``weight-only int8 (simulated)``: the same int8 weights dequantized back to float32, float32 matmuls: the error of
  the weights alone;
* ``smoothquant a=...``: per-input-channel scales ``s = max|x|^a / max|w|^(1-a)`` calibrated on 8 other prompts in
  float32, divided out of the activations (folded into the RMSNorm weights before QKV, gate/up and the LM head; an
  explicit multiply before o_proj and down_proj) and multiplied into the weights before int8 quantization.

    .venv/bin/python benchmarks/int8_agreement.py        # ~3 min; writes benchmarks/results/int8_agreement.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import tailguard.engine.torch_model as model_mod
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

PROMPTS = ["Write a short story about a robot who learns to paint.", "What causes the seasons on Earth?",
           "请用一句话介绍一下北京。", "Give me three tips for writing clean Python code.", "什么是机器学习？",
           "Why is the sky blue?"]
CALIBRATION = ["Explain how a bicycle stays upright while moving.", "Describe the water cycle to a ten-year-old.",
               "请解释一下为什么天空是蓝色的。", "推荐三本适合初学者的编程书。", "List some good habits for getting better sleep.",
               "What is the capital of France?", "写一首关于大海的短诗。", "Summarize the plot of a heist movie."]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class _Prescaled:
    """x -> lin(x / s): the smoothing factor of an input that has no norm weight to fold it into."""

    def __init__(self, lin: model_mod.Linear, s: torch.Tensor) -> None:
        self.lin, self.inv, self.out_features = lin, 1.0 / s, lin.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.inv)


def _engine(fmt: str) -> LLMEngine:
    return LLMEngine(EngineArgs(model="smollm2", weight_format=fmt, num_threads=2))


def _run(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    return engine.generate([tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS], GREEDY)


def _calibrate(engine: LLMEngine) -> list:
    """max |x| per input channel of every Linear, over float32 runs of the calibration prompts: per layer
    (qkv, o, gate_up, down), then the LM head's."""
    stats: dict[int, torch.Tensor] = {}
    original = model_mod.Linear.__call__

    def recording(self, x):
        m = x.detach().abs().amax(dim=0)
        stats[id(self)] = torch.maximum(stats[id(self)], m) if id(self) in stats else m
        return original(self, x)

    model_mod.Linear.__call__ = recording
    try:
        tok = engine.tokenizer
        engine.generate([tok.encode_chat([{"role": "user", "content": p}]) for p in CALIBRATION],
                        SamplingParams(max_tokens=16, temperature=0))
    finally:
        model_mod.Linear.__call__ = original
    m = engine.model
    return [[stats[id(lin)] for lin in (qkv, o, gu, d)] for _, qkv, o, _, gu, d in m.layers] + [stats[id(m.lm_head)]]


def _smoothquant(engine: LLMEngine, stats: list, alpha: float) -> None:
    """Turn a float32 engine's model into smoothed int8, in place."""
    m = engine.model

    def scale(lin, x_max: torch.Tensor) -> torch.Tensor:
        w_max = lin.weight.float().abs().amax(dim=0).clamp(min=1e-5)
        return x_max.clamp(min=1e-5) ** alpha / w_max ** (1 - alpha)

    def int8(lin, s) -> model_mod.Linear:
        return model_mod.Linear(lin.weight * s, "int8")

    layers = []
    for (attn_norm, qkv, o, ffn_norm, gate_up, down), (x_qkv, x_o, x_gu, x_down) in zip(m.layers, stats):
        s_qkv, s_gu, s_o, s_down = scale(qkv, x_qkv), scale(gate_up, x_gu), scale(o, x_o), scale(down, x_down)
        layers.append((attn_norm / s_qkv, int8(qkv, s_qkv), _Prescaled(int8(o, s_o), s_o), ffn_norm / s_gu,
                       int8(gate_up, s_gu), _Prescaled(int8(down, s_down), s_down)))
    s_head = scale(m.lm_head, stats[-1])
    m.norm = m.norm / s_head
    m.lm_head = int8(m.lm_head, s_head)
    m.layers = layers


def _weight_only(engine: LLMEngine) -> None:
    """int8 weights dequantized to float32 (the weights' own error, float32 matmuls), in place."""
    m = engine.model

    def fake_quant(lin) -> model_mod.Linear:
        w = lin.weight.float()
        s = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-8)
        return model_mod.Linear(torch.round(w / s).clamp(-127, 127) * s, "float32")

    m.layers = [(a, fake_quant(q), fake_quant(o), f, fake_quant(g), fake_quant(d)) for a, q, o, f, g, d in m.layers]
    m.lm_head = fake_quant(m.lm_head)


def _compare(ref: list[list[int]], out: list[list[int]]) -> dict:
    same = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o))
    total = sum(len(r) for r in ref)
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(ref, out)]
    return {"identical_tokens": same, "tokens": total, "share": same / total, "first_divergence": firsts}


def main() -> int:
    torch.set_num_threads(2)
    console = Console(width=None if sys.stdout.isatty() else 120)
    fp32 = _engine("float32")
    ref = _run(fp32)
    stats = _calibrate(fp32)
    rows: dict[str, dict] = {}
    with console.status("int8 (fbgemm dynamic) ..."):
        rows["int8 (fbgemm dynamic)"] = _compare(ref, _run(_engine("int8")))
    with console.status("weight-only int8 ..."):
        eng = _engine("float32")
        _weight_only(eng)
        rows["weight-only int8 (simulated)"] = _compare(ref, _run(eng))
    for alpha in (0.5, 0.75, 0.9):
        with console.status(f"smoothquant a={alpha} ..."):
            eng = _engine("float32")
            _smoothquant(eng, stats, alpha)
            rows[f"smoothquant a={alpha}"] = _compare(ref, _run(eng))
    table = Table(title=f"Greedy agreement with float32 ({len(PROMPTS)} prompts x {GREEDY.max_tokens} tokens)")
    for col in ("variant", "identical tokens", "first divergence per prompt"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, r in rows.items():
        table.add_row(name, f"{r['identical_tokens']}/{r['tokens']} ({r['share']:.0%})",
                      " ".join(str(x) for x in r["first_divergence"]))
    console.print(table)
    out = Path(__file__).resolve().parent / "results" / "int8_agreement.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/int8_agreement.py", "rows": rows}, indent=2))
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
