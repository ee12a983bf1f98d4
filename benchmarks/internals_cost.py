#!/usr/bin/env python
"""What sampled internals (T2) cost: decode tokens/s with internals_sample_rate 0, 0.01 and 1.0, same engine, same run.

One engine (the real SmolLM2-135M, native weights unless --weight-format says otherwise); the sample rate is changed
between batches, and the batches of the three rates are interleaved (0, 0.01, 1.0, 0, ...) so that load on the
machine hits them alike. Each batch runs ``--batch`` requests together to ``--max-tokens`` tokens (greedy, EOS
ignored). Decode tokens/s counts only decode-only steps (no prefill chunk in them): tokens they produced over their
wall time. Instrumented steps (a sampled request's prefill, its first decode step and every 16th after) are timed
apart, against plain decode steps, which is the cost a sampled step pays: it leaves the one-call C decode step for
the torch path and stops after every layer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/internals_cost.py     # writes benchmarks/results/internals_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

RATES = (0.0, 0.01, 1.0)


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, acc: dict) -> None:
    """Run one batch to completion, adding its decode-only steps to ``acc`` (plain and instrumented apart)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    acc["sampled"] += sum(engine.internals.is_sampled(i) for i in ids)
    probed: list[bool] = []
    plan = engine.internals.plan

    def spy(chunks, tables):
        probe = plan(chunks, tables)
        probed.append(probe is not None)
        return probe

    engine.internals.plan = spy  # type: ignore[method-assign]
    try:
        while engine.has_unfinished():
            decode_only = all(seq.output_token_ids for seq in engine.scheduler.running) and \
                engine.scheduler.num_waiting == 0
            t0 = time.perf_counter()
            events = engine.step()
            dt = time.perf_counter() - t0
            tokens = sum(ev.token_id is not None for ev in events)
            if not decode_only or not tokens:
                continue
            key = "probed" if probed and probed[-1] else "plain"
            acc[key + "_s"] += dt
            acc[key + "_tokens"] += tokens
            acc[key + "_steps"].append(dt)
    finally:
        del engine.internals.plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--weight-format", default="auto")
    ap.add_argument("--rounds", type=int, default=12, help="batches per rate")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "internals_cost.json"))
    args = ap.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    engine = LLMEngine(EngineArgs(model=args.model, weight_format=args.weight_format, kv_cache_tokens=8192,
                                  num_threads=threads, max_num_seqs=args.batch, internals_seed=args.seed))
    rng = random.Random(args.seed)
    vocab = engine.config.vocab_size
    accs = {r: {"sampled": 0, "requests": 0, "plain_s": 0.0, "plain_tokens": 0, "plain_steps": [],
                "probed_s": 0.0, "probed_tokens": 0, "probed_steps": []} for r in RATES}
    warm = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
    run_batch(engine, warm, 8, {"sampled": 0, "plain_s": 0.0, "plain_tokens": 0, "plain_steps": [],
                                "probed_s": 0.0, "probed_tokens": 0, "probed_steps": []})
    for _ in range(args.rounds):
        for rate in RATES:
            engine.internals.sample_rate = rate
            prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.batch)]
            accs[rate]["requests"] += len(prompts)
            run_batch(engine, prompts, args.max_tokens, accs[rate])
    rows = []
    base = None
    for rate in RATES:
        a = accs[rate]
        total_s = a["plain_s"] + a["probed_s"]
        tokens = a["plain_tokens"] + a["probed_tokens"]
        tps = tokens / total_s
        base = base or tps
        rows.append({
            "sample_rate": rate, "requests": a["requests"], "sampled": a["sampled"],
            "decode_steps": len(a["plain_steps"]) + len(a["probed_steps"]),
            "instrumented_steps": len(a["probed_steps"]),
            "decode_tokens_per_s": round(tps, 1), "vs_off": round(tps / base, 4),
            "plain_step_ms_median": round(statistics.median(a["plain_steps"]) * 1e3, 3) if a["plain_steps"] else None,
            "instrumented_step_ms_median": round(statistics.median(a["probed_steps"]) * 1e3, 3)
            if a["probed_steps"] else None,
        })
    # What a rate costs by the step model: a batch with at least one sampled request runs the instrumented steps that
    # rate 1.0 ran per batch, each paying (instrumented - plain) step time; a batch without one is unchanged. Rate 0.01
    # samples about one request in a hundred, too few in a short run to measure against the noise directly.
    full = rows[-1]
    if full["instrumented_steps"] and full["plain_step_ms_median"]:
        per_batch = full["instrumented_steps"] / args.rounds
        extra = per_batch * (full["instrumented_step_ms_median"] - full["plain_step_ms_median"])
        base_ms = full["decode_steps"] / args.rounds * full["plain_step_ms_median"]
        for r in rows:
            hit = 1 - (1 - r["sample_rate"]) ** args.batch
            r["modelled_cost"] = round(hit * extra / base_ms, 4)
    print(f"{engine.model_name} ({engine.weight_format} weights, {engine.config.num_layers} layers), "
          f"{threads} thread(s); "
          f"{args.rounds} batches of {args.batch} x {args.max_tokens} tokens per rate, interleaved")
    print(f"{'rate':>6} {'requests':>8} {'sampled':>7} {'decode steps':>12} {'instrumented':>12} {'decode tok/s':>12} "
          f"{'vs off':>7} {'plain step ms':>13} {'instr. step ms':>14} {'modelled cost':>13}")
    for r in rows:
        print(f"{r['sample_rate']:>6g} {r['requests']:>8} {r['sampled']:>7} {r['decode_steps']:>12} "
              f"{r['instrumented_steps']:>12} {r['decode_tokens_per_s']:>12.1f} {r['vs_off']:>7.3f} "
              f"{r['plain_step_ms_median'] or 0:>13.2f} {r['instrumented_step_ms_median'] or 0:>14.2f} "
              f"{r.get('modelled_cost', 0):>13.2%}")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_args = {k: v for k, v in vars(args).items() if k != "output"}
    out.write_text(json.dumps({"model": engine.model_name, "weight_format": engine.weight_format, "threads": threads,
                               "args": run_args, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
