#!/usr/bin/env python
"""Long-context decay with attention slicing on and off, same run, real model (SmolLM2-135M, native weights).

Three measurements, each with ``attention_slice_tokens`` = the default (sliced) and 0 (single-shot attention):

1. attention alone, one layer, SmolLM2's shapes (9 query heads over 3 KV heads of 64, float16 KV): a decode step of
   4 sequences at 2K/4K/8K context and a 256-token prefill chunk at the end of an 8K prompt; ms per call (median,
   sliced and single-shot interleaved).
2. one request alone at ~256, 2K, 4K and 8K tokens of context (prompt + 32 greedy tokens, SmolLM2's 8192 positions
   at most): TTFT (the chunked prefill: every chunk after the first attends to its cached prefix, tiled when sliced),
   decode ms/step (ITL mean; decode-only steps run in tg_kernels.c, which always streams 256-key slices) and E2E.
   With ``--repeats`` R, P99 E2E is the R samples' 99th percentile (= their maximum for R < 100).
3. four short streams decoding while one ~8K-token prompt is prefilled beside them in 256-token chunks: the streams'
   ITL P50/P99/max during the prefill (every step then runs in torch: chunk + decodes), against the same streams
   alone. Does the long prefill stall them? Chunked prefill bounds each step to one chunk; slicing bounds what the
   chunk's attention holds.

Prefix caching is off (the same prompt is sent again). Modes alternate (sliced first in odd repeats) so that load
from other processes on a shared machine hits both alike; timestamps are the engine's own (time.perf_counter).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py    # writes benchmarks/results/long_context.json
    .venv/bin/python benchmarks/long_context.py --quick              # 256 and 2K only, no side-by-side part
    .venv/bin/python benchmarks/long_context.py --only-attention --sweep 512,1024,2048,4096 --out /tmp/sweep.json
                                                                     # part 1 at several slice sizes (the default's
                                                                     # choice); --only-side --reverse: part 3 only,
                                                                     # single-shot first (an order check)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads: the machine is shared

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from tailguard.engine.engine import EngineArgs, LLMEngine, TokenEvent  # noqa: E402
from tailguard.engine.sequence import SamplingParams  # noqa: E402
from tailguard.engine.torch_model import (  # noqa: E402
    DEFAULT_ATTENTION_SLICE_TOKENS,
    AttentionMetadata,
    LlamaModel,
    _kv_values,
    prefill_attention_tiled,
)

HERE = Path(__file__).resolve().parent
TEXTS = [HERE / "data" / "heldout_en.txt", HERE / "data" / "heldout_zh.txt"]
OUTPUT_TOKENS = 32
MAX_POSITION = 8192


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def long_prompt(engine: LLMEngine, n_tokens: int) -> list[int]:
    """n_tokens of real text: the held-out texts, repeated as needed."""
    base: list[int] = []
    for path in TEXTS:
        base += engine.tokenizer.encode(path.read_text(encoding="utf-8"))
    return (base * (n_tokens // len(base) + 1))[:n_tokens]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
        add_later: tuple[list[int], int, int] | None = None) -> dict[str, list[TokenEvent]]:
    """Serve prompts to completion; ``add_later`` = (prompt, max_tokens, after_step): one more request added once
    that many steps have run. Returns each request's events, the added one under the key 'long'."""
    ids = {engine.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)): f"s{i}"
           for i, (p, m) in enumerate(zip(prompts, max_tokens))}
    events: dict[str, list[TokenEvent]] = {name: [] for name in ids.values()}
    steps = 0
    while engine.has_unfinished():
        if add_later is not None and steps == add_later[2]:
            rid = engine.add_request(add_later[0], SamplingParams(max_tokens=add_later[1], temperature=0,
                                                                  ignore_eos=True))
            ids[rid] = "long"
            events["long"] = []
        for ev in engine.step():
            events[ids[ev.request_id]].append(ev)
        steps += 1
    return events


def token_times(events: list[TokenEvent]) -> list[float]:
    return [ev.time for ev in events if ev.token_id is not None]


# --- 1. attention alone ----------------------------------------------------------------------------------------

def attention_alone(slice_tokens: int, reps: int, sweep: list[int]) -> list[dict]:
    """ms per call, sliced at ``slice_tokens`` and single-shot (and at each ``sweep`` size, keys 'slice N')."""
    n_heads, n_kv, hd, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    rows = []

    def timed(fns: dict[str, callable]) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(reps):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
        return {k: statistics.median(v) for k, v in times.items()}

    for ctx in (2048, 4096, 8192):
        d, blocks = 4, ctx // bs
        k_cache = torch.randn(d * blocks, bs, n_kv, hd, generator=gen).half()
        v_cache = torch.randn(d * blocks, bs, n_kv, hd, generator=gen).half()
        lens = torch.full((d,), ctx, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(d, dtype=torch.long), positions=lens.long() - 1, num_decodes=d,
            decode_gather=torch.randperm(d * blocks, generator=gen).view(d, blocks),
            decode_mask=torch.ones(d, 1, 1, ctx, dtype=torch.bool), prefills=[], decode_lens=lens)
        q = torch.randn(d, n_heads, hd, generator=gen)
        ms = timed({mode: (lambda s=s, q=q, k=k_cache, v=v_cache, m=meta: LlamaModel._decode_attention(q, k, v, m, s))
                    for mode, s in [("sliced", slice_tokens), ("single", 0)] + [(f"slice {n}", n) for n in sweep]})
        rows.append({"case": f"decode, 4 seqs x {ctx}", **ms})
    ctx, n = 8192, 256
    blocks = ctx // bs
    k_cache = torch.randn(blocks, bs, n_kv, hd, generator=gen).half()
    v_cache = torch.randn(blocks, bs, n_kv, hd, generator=gen).half()
    gather = torch.randperm(blocks, generator=gen)
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    q = torch.randn(n_heads, n, hd, generator=gen)

    def single_shot():
        k = _kv_values(k_cache[gather], q.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        v = _kv_values(v_cache[gather], q.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
        return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(0), k, v, attn_mask=mask, enable_gqa=True)

    ms = timed({"sliced": lambda: prefill_attention_tiled(q, k_cache, v_cache, gather, mask, slice_tokens),
                "single": single_shot,
                **{f"slice {n}": (lambda n=n: prefill_attention_tiled(q, k_cache, v_cache, gather, mask, n))
                   for n in sweep}})
    rows.append({"case": f"prefill chunk {n} at {ctx}", **ms})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=int(os.environ["OMP_NUM_THREADS"]))
    ap.add_argument("--slice-tokens", type=int, default=DEFAULT_ATTENTION_SLICE_TOKENS)
    ap.add_argument("--contexts", default="256,2048,4096,8160", help="prompt lengths in tokens (+32 generated)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--streams", type=int, default=4, help="short streams beside the long prefill")
    ap.add_argument("--quick", action="store_true", help="contexts 256 and 2048, no side-by-side part")
    ap.add_argument("--only-side", action="store_true", help="parts 1 and 3 only (the streams beside the prefill)")
    ap.add_argument("--sweep", default="", help="slice sizes to time in part 1 too, e.g. 512,1024,2048,4096")
    ap.add_argument("--only-attention", action="store_true", help="part 1 only")
    ap.add_argument("--reverse", action="store_true", help="single-shot before sliced in part 3 (order check)")
    ap.add_argument("--out", default=str(HERE / "results" / "long_context.json"))
    args = ap.parse_args()
    contexts = [256, 2048] if args.quick else [int(c) for c in args.contexts.split(",")]
    if any(c < 16 or c + OUTPUT_TOKENS > MAX_POSITION for c in contexts) or args.slice_tokens < 1:
        ap.error(f"contexts must be 16..{MAX_POSITION - OUTPUT_TOKENS} tokens and --slice-tokens at least 1")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()

    print(f"1. attention alone, one layer (slice {args.slice_tokens} vs single-shot), ms per call", flush=True)
    sweep = [int(n) for n in args.sweep.split(",") if n]
    alone = attention_alone(args.slice_tokens, reps=3 if args.quick else 7, sweep=sweep)
    for row in alone:
        extra = "".join(f"   {k} {v:7.1f}" for k, v in row.items() if k.startswith("slice "))
        print(f"  {row['case']:<28} sliced {row['sliced']:7.1f}   single-shot {row['single']:7.1f}{extra}", flush=True)
    if args.only_attention:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "long_context (attention alone)", "threads": args.threads,
                                              "slice_tokens": args.slice_tokens, "attention_alone_ms": alone,
                                              "load_average_before": load_before, "torch": torch.__version__,
                                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                             indent=2) + "\n")
        print(f"wrote {args.out}")
        return

    common = dict(model=args.model, num_threads=args.threads, kv_cache_tokens=16384, max_num_batched_tokens=512,
                  max_prefill_chunk=256, enable_prefix_caching=False, max_model_len=MAX_POSITION,
                  kv_cache_dtype="float16", runner="torch")  # the torch paths' slicing, as documented
    modes = {"sliced": args.slice_tokens, "single": 0}
    engines = {mode: LLMEngine(EngineArgs(attention_slice_tokens=s, **common)) for mode, s in modes.items()}
    prompts = {c: long_prompt(engines["sliced"], c) for c in contexts}
    for engine in engines.values():  # warm-up: kernels compiled, first-call allocations done
        run(engine, [prompts[contexts[0]][:64]], [4])

    print("\n2. one request alone: context -> TTFT, decode ms/step, E2E", flush=True)
    single: dict[str, dict[int, dict[str, list[float]]]] = {
        m: {c: {"ttft_s": [], "itl_ms": [], "e2e_s": []} for c in contexts} for m in modes}
    outputs: dict[str, dict[int, list[int]]] = {m: {} for m in modes}
    for rep in range(0 if args.only_side else args.repeats):
        for c in contexts:
            for mode in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
                ev = run(engines[mode], [prompts[c]], [OUTPUT_TOKENS])["s0"]
                times, final = token_times(ev), ev[-1]
                rec = single[mode][c]
                rec["ttft_s"].append(final.first_token - final.arrival)
                rec["itl_ms"].append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
                rec["e2e_s"].append(times[-1] - final.arrival)
                outputs[mode][c] = [e.token_id for e in ev if e.token_id is not None]
                print(f"  {mode:<6} {c:>5} tokens: TTFT {rec['ttft_s'][-1]:7.2f} s, decode {rec['itl_ms'][-1]:6.1f} "
                      f"ms/step, E2E {rec['e2e_s'][-1]:7.2f} s", flush=True)
    same_outputs = all(outputs["sliced"][c] == outputs["single"][c] for c in outputs["sliced"])

    side: dict[str, dict] = {}
    if not args.quick:
        long_len = contexts[-1]
        print(f"\n3. {args.streams} short streams beside one {long_len}-token prefill: the streams' ITL", flush=True)
        short = [prompts[contexts[0]][i * 7 : i * 7 + 64] for i in range(args.streams)]
        chunks = -(-long_len // 256)
        # the streams must outlast the long prefill: one token per step, one chunk per step
        stream_tokens = chunks + 16
        for mode in list(modes)[::-1] if args.reverse else list(modes):
            alone_ev = run(engines[mode], short, [stream_tokens] * args.streams)
            base_itl = [b - a for name, ev in alone_ev.items() for a, b in zip(token_times(ev), token_times(ev)[1:])]
            ev = run(engines[mode], short, [stream_tokens] * args.streams, add_later=(prompts[long_len], 8, 4))
            long_ev = ev.pop("long")
            window = (long_ev[-1].arrival, long_ev[-1].first_token)  # the long prompt's prefill
            itl = [b - a for e in ev.values() for a, b in zip(token_times(e), token_times(e)[1:])
                   if window[0] <= a and b <= window[1]]
            side[mode] = {
                "alone_itl_p50_ms": percentile(base_itl, 50) * 1e3, "alone_itl_p99_ms": percentile(base_itl, 99) * 1e3,
                "during_prefill_itl_p50_ms": percentile(itl, 50) * 1e3,
                "during_prefill_itl_p99_ms": percentile(itl, 99) * 1e3,
                "during_prefill_itl_max_ms": max(itl) * 1e3, "intervals_during_prefill": len(itl),
                "long_ttft_s": window[1] - window[0],
            }
            print(f"  {mode:<6}: streams alone ITL P99 {side[mode]['alone_itl_p99_ms']:7.1f} ms; during the prefill "
                  f"P50 {side[mode]['during_prefill_itl_p50_ms']:7.1f}, P99 {side[mode]['during_prefill_itl_p99_ms']:7.1f},"
                  f" max {side[mode]['during_prefill_itl_max_ms']:7.1f} ms ({len(itl)} intervals); long TTFT "
                  f"{side[mode]['long_ttft_s']:.1f} s", flush=True)

    wall = time.perf_counter() - t_start
    load_after = os.getloadavg()[0]
    if args.only_side:
        single = {m: {} for m in modes}
    summary = {m: {c: {"ttft_s": statistics.median(r["ttft_s"]), "decode_ms_per_step": statistics.median(r["itl_ms"]),
                       "e2e_p50_s": percentile(r["e2e_s"], 50), "e2e_p99_s": percentile(r["e2e_s"], 99)}
                   for c, r in per_ctx.items()} for m, per_ctx in single.items()}
    base = contexts[0]
    print(f"\n{'context':>8} | {'TTFT s':>15} | {'decode ms/step':>15} | {'P99 E2E s':>15} | {'E2E vs ' + str(base):>15}")
    print(f"{'':>8} | {'sliced  single':>15} | {'sliced  single':>15} | {'sliced  single':>15} | {'sliced  single':>15}")
    for c in contexts if not args.only_side else []:
        s, u = summary["sliced"][c], summary["single"][c]
        print(f"{c:>8} | {s['ttft_s']:7.2f} {u['ttft_s']:7.2f} | {s['decode_ms_per_step']:7.1f} "
              f"{u['decode_ms_per_step']:7.1f} | {s['e2e_p99_s']:7.2f} {u['e2e_p99_s']:7.2f} | "
              f"{s['e2e_p99_s'] / summary['sliced'][base]['e2e_p99_s']:6.1f}x "
              f"{u['e2e_p99_s'] / summary['single'][base]['e2e_p99_s']:6.1f}x")
    print(f"identical greedy outputs sliced vs single-shot: {same_outputs}; wall {wall:.0f} s; "
          f"load average {load_before:.2f} -> {load_after:.2f}")
    result = {
        "benchmark": "long_context", "model": args.model, "weight_format": engines["sliced"].weight_format,
        "kv_cache_dtype": str(engines["sliced"].kv_dtype), "threads": args.threads,
        "slice_tokens": args.slice_tokens, "repeats": args.repeats, "side_order_reversed": args.reverse, "output_tokens": OUTPUT_TOKENS,
        "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__,
        "load_average_before": load_before, "load_average_after": load_after,
        "attention_alone_ms": alone, "single_request": summary, "single_request_samples": single,
        "beside_long_prefill": side, "identical_outputs": same_outputs, "wall_s": wall,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
