"""Prompt rows of the C step: the block kernels against the matrix units (AMX, bfloat16 tiles), same process.

    .venv/bin/python benchmarks/prompt_rows.py            # ~3 min; writes benchmarks/results/prompt_rows.json

1. speed: TTFT of one prompt (max_tokens 1, no prefix cache) at 512 and 1,536 tokens, chunks of 256 in a 512-token
   step budget (the server's defaults) and one 512-token chunk, the two engines alternating, median of --repeats;
   and where a 512-token chunk's time goes (the C step's phase timers).
2. fidelity: perplexity of every position of the shipped held-out texts (benchmarks/data/heldout_*.txt, first 2,048
   tokens) scored as prompt rows (chunks of 256, logits at every row), float32 weights and KV in torch as the
   reference; the mean per-token |change of -log p| beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def engine_with(prompt_bf16: bool, **kw):
    from tailguard.engine import kernels
    from tailguard.engine.engine import EngineArgs, LLMEngine

    os.environ[kernels.PROMPT_BF16_ENV] = "1" if prompt_bf16 else "0"
    return LLMEngine(EngineArgs(model="smollm2", enable_prefix_caching=False, **kw))


def ttft(engine, ids: list[int]) -> float:
    from tailguard.engine.sequence import SamplingParams

    t0 = time.perf_counter()
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - t0


def nll_rows(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return np.log(np.exp(x).sum(axis=1)) - x[np.arange(len(targets)), targets]


def score_prompt_rows(engine, ids: list[int], chunk: int = 256) -> np.ndarray:
    """-log p of ids[1:], every position a prompt row."""
    from tailguard.engine.blocks import BlockTable
    from tailguard.engine.scheduler import ScheduledChunk
    from tailguard.engine.sequence import SamplingParams, Sequence

    runner = engine.runner
    table = BlockTable(engine.pool, "score")
    assert table.ensure(len(ids))
    seq = Sequence(request_id="score", prompt_token_ids=list(ids), sampling=SamplingParams())
    out = []
    try:
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - start)
            c = ScheduledChunk(seq, start, n)
            if hasattr(runner, "_step"):  # the native runner: the C step, every row's logits
                tokens, pos, slots, tabs, lens, _, decode_rows = runner._build([c], {"score": table})
                logits = runner._step(tokens, pos, slots, tabs, lens, None, decode_rows)
            else:  # the torch reference
                import torch

                input_ids, meta, _ = runner._build([c], {"score": table})
                logits = runner.model.forward(input_ids, meta, runner.kv_cache, torch.arange(n)).float().numpy()
            out.append(nll_rows(logits, np.array(ids[start + 1 : start + n + 1])))
            seq.num_computed_tokens = start + n
    finally:
        table.release()
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "prompt_rows.json"))
    args = ap.parse_args()
    from tailguard.engine import kernels

    if not kernels.amx_available():
        raise SystemExit("this CPU (or OS) offers no AMX tiles: nothing to compare")
    rng = np.random.default_rng(0)
    speed = []
    print(f"{'prompt':>6} | {'chunk':>5} | {'blocks':>8} | {'tiles':>8} | blocks / tiles", flush=True)
    for chunk in (256, 512):
        engines = {mode: engine_with(mode == "tiles", num_threads=args.threads, max_num_batched_tokens=512,
                                     max_prefill_chunk=chunk) for mode in ("blocks", "tiles")}
        for length in (512, 1536):
            ids = rng.integers(100, 40000, size=length).tolist()
            times: dict[str, list[float]] = {"blocks": [], "tiles": []}
            for e in engines.values():
                ttft(e, ids)  # warm
            for _ in range(args.repeats):
                for mode, e in engines.items():
                    times[mode].append(ttft(e, ids))
            b, t = statistics.median(times["blocks"]), statistics.median(times["tiles"])
            speed.append({"prompt_tokens": length, "chunk": chunk, "blocks_s": b, "tiles_s": t, "runs": times,
                          "blocks_tok_s": length / b, "tiles_tok_s": length / t})
            print(f"{length:>6} | {chunk:>5} | {b * 1000:>6.0f}ms | {t * 1000:>6.0f}ms | {b / t:.2f}x "
                  f"({length / b:.0f} vs {length / t:.0f} tok/s)", flush=True)
        if chunk == 512:
            phases = {}
            ids = rng.integers(100, 40000, size=512).tolist()
            for mode, e in engines.items():
                kernels.profile_decode(True)
                ttft(e, ids)
                phases[mode] = {k: round(v * 1000, 1) for k, v in kernels.profile_read().items()}
                kernels.profile_decode(False)
                print(f"phases ms, 512-token chunk, {mode}: {phases[mode]}", flush=True)
        del engines
    texts = {k: (HERE / "data" / f"heldout_{k}.txt").read_text() for k in ("en", "zh")}
    paths = [("float32", dict(weight_format="float32", kv_cache_dtype="float32", runner="torch"), False),
             ("blocks", {}, False), ("tiles", {}, True)]
    nll: dict[str, dict[str, np.ndarray]] = {}
    for name, kw, bf16 in paths:
        e = engine_with(bf16, num_threads=args.threads, **kw)
        nll[name] = {lang: score_prompt_rows(e, e.tokenizer.encode(t)[:2048]) for lang, t in texts.items()}
        del e
    fidelity = []
    for lang in texts:
        ref = nll["float32"][lang]
        for name in ("float32", "blocks", "tiles"):
            x = nll[name][lang]
            row = {"text": lang, "path": name, "tokens": int(len(x)), "perplexity": math.exp(x.mean()),
                   "vs_float32_pct": 100 * (math.exp(x.mean() - ref.mean()) - 1),
                   "mean_abs_dnll": float(np.abs(x - ref).mean())}
            fidelity.append(row)
            print(f"{lang} {name:>8}: perplexity {row['perplexity']:.3f} ({row['vs_float32_pct']:+.2f}% vs float32), "
                  f"mean |d -log p| {row['mean_abs_dnll']:.4f}, {row['tokens']} tokens", flush=True)
    out = {"benchmark": "prompt_rows", "threads": args.threads, "speed": speed, "phases_ms": phases,
           "fidelity": fidelity, "load": os.getloadavg()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
