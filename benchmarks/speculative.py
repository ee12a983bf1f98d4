#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup, self-draft or a draft model) on the real model: decode tokens/s with and without, same run.

One engine with speculation on; the "without" runs opt out per request (SamplingParams.speculative=False), so both
share weights, KV cache and thread pool, and are interleaved (off, on, off, on, ...) so that load on the machine hits
both alike. Single stream: per prompt, the median of 3 decode rates (tokens after the first / time from the first
token to the last), greedy output compared token for token. Then N concurrent streams, aggregate tokens/s, with the
default batch cutoff (speculative_max_running) and with the cutoff lifted (what speculation would cost a busy batch).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/speculative.py       # writes benchmarks/results/speculative.json
    .venv/bin/python benchmarks/speculative.py --proposer self --sweep ""   # speculative_self.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from tailguard.engine.engine import EngineArgs, LLMEngine, TokenEvent
from tailguard.engine.sequence import SamplingParams

PROMPTS: dict[str, list[str]] = {
    "json": [
        "Extract the customer's name, email, city and order number from this message and answer with JSON only: "
        "'Hello, my name is Maria Lopez, my email is maria.lopez@example.com. I live in Seattle and my order "
        "number 48213 arrived damaged.'",
        'Convert this record to JSON with keys "product", "price", "quantity", "currency": Product: wireless mouse; '
        "Price: 24.99; Quantity: 3; Currency: USD.",
    ],
    "repeat_fix": [
        "Repeat the following text exactly, fixing only the spelling mistakes: 'The quick brown fox jumpd over the "
        "lazy dog. Tehn it ran into the forrest and was nevr seen again by the farmer or his dog.'",
        "Rewrite this paragraph with the typos corrected and nothing else changed: 'Our store opens at nine in the "
        "morining and closes at six in the evenning. Custommers can return items within thirty days.'",
    ],
    "code_edit": [
        "Rename the variable x to total in this Python code and return the whole code:\n"
        "def add_all(values):\n    x = 0\n    for v in values:\n        x = x + v\n    return x\n",
        "Add a docstring to this function and return the whole function:\n"
        "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')\n"
        "    return width * height\n",
    ],
    "free_chat": [
        "Tell me a short story about a robot who learns to paint.",
        "What are three good habits for staying healthy?",
    ],
}
FORMATTED = ("json", "repeat_fix", "code_edit")


def run(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> tuple[list[list[TokenEvent]], float]:
    """Run prompts together; each request's events and the wall time from the first token to the last."""
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    events: dict[str, list[TokenEvent]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    out = [events[rid] for rid in ids]
    first = min(ev[0].time for ev in out)
    last = max(ev[-1].time for ev in out)
    return out, last - first


def tokens(events: list[TokenEvent]) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]


def decode_rate(events: list[TokenEvent]) -> float:
    """Decode tokens/s of one stream: tokens after the first over the time from the first to the last."""
    times = [ev.time for ev in events if ev.token_id is not None]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def single_stream(engine: LLMEngine, encoded: dict[str, list[list[int]]], max_tokens: int, reps: int) -> list[dict]:
    rows = []
    for category, prompts in encoded.items():
        for i, prompt in enumerate(prompts):
            rates: dict[bool, list[float]] = {False: [], True: []}
            outputs: dict[bool, list[int]] = {}
            proposed = accepted = verify_steps = 0
            steps = {False: 0, True: 0}  # target passes of the last run: independent of the machine's load
            for rep in range(reps):
                for spec in (False, True) if rep % 2 == 0 else (True, False):
                    before = engine.stats()
                    sp = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=spec)
                    [events], _ = run(engine, [prompt], sp)
                    rates[spec].append(decode_rate(events))
                    outputs[spec] = tokens(events)
                    after = engine.stats()
                    steps[spec] = after.steps - before.steps
                    if spec:
                        proposed += events[-1].num_spec_proposed
                        accepted += events[-1].num_spec_accepted
                        verify_steps += after.num_spec_steps - before.num_spec_steps
            off, on = statistics.median(rates[False]), statistics.median(rates[True])
            rows.append(dict(
                category=category, prompt=i, tokens=len(outputs[True]), off_tps=round(off, 1), on_tps=round(on, 1),
                speedup=round(on / off, 3) if off else None, identical=outputs[True] == outputs[False],
                off_steps=steps[False], on_steps=steps[True],
                proposed=proposed, accepted=accepted,
                acceptance=round(accepted / proposed, 3) if proposed else None,
                mean_accepted_len=round(accepted / verify_steps, 2) if verify_steps else None,
                verify_steps=verify_steps))
            print(f"  {category}[{i}]: off {off:.1f}  on {on:.1f} tok/s  x{on / off:.2f}  "
                  f"accept {accepted}/{proposed}  identical={outputs[True] == outputs[False]}", flush=True)
    return rows


def concurrent(engine: LLMEngine, prompts: list[list[int]], streams: int, max_tokens: int, reps: int,
               max_running: int) -> dict:
    engine.speculation.max_running = max_running
    batch = [prompts[i % len(prompts)] for i in range(streams)]
    agg: dict[bool, list[float]] = {False: [], True: []}
    identical = True
    verify_steps = 0  # verifications in all "on" runs: with the cutoff in force, the runs are the same work
    outs: dict[bool, list[list[int]]] = {}
    for rep in range(reps):
        for spec in (False, True) if rep % 2 == 0 else (True, False):  # alternate the order: drift hits both
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=spec, ignore_eos=True)
            before = engine.stats().num_spec_steps
            results, wall = run(engine, batch, sp)
            verify_steps += engine.stats().num_spec_steps - before
            outs[spec] = [tokens(ev) for ev in results]
            agg[spec].append(sum(len(o) for o in outs[spec]) / wall)
        identical &= outs[True] == outs[False]
    off, on = statistics.median(agg[False]), statistics.median(agg[True])
    cutoff = "none" if max_running >= 1 << 30 else max_running
    print(f"  {streams} streams, cutoff {cutoff}: off {off:.1f}  on {on:.1f} tok/s  x{on / off:.2f}  "
          f"verifications {verify_steps}", flush=True)
    return dict(streams=streams, speculative_max_running=max_running, off_tps=round(off, 1), on_tps=round(on, 1),
                ratio=round(on / off, 3), identical=identical, verify_steps=verify_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--sweep", default="2,4,8", help="stream counts run with speculation on every stream")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--proposer", default="ngram",
                    help="ngram, self (the first quarter of the layers) or draft:PATH|ALIAS (draft:smollm2 drafts for "
                         "itself: every guess right, at a second model's cost)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/speculative[_PROPOSER].json")
    args = ap.parse_args()
    if args.out is None:
        suffix = "" if args.proposer == "ngram" else "_" + args.proposer.replace("draft:", "draft_").replace("/", "_")
        args.out = str(Path(__file__).parent / "results" / f"speculative{suffix}.json")

    engine = LLMEngine(EngineArgs(model="smollm2", num_threads=args.threads, kv_cache_tokens=8192,
                                  speculative=args.proposer, num_speculative_tokens=args.num_speculative_tokens))
    default_cutoff = engine.args.speculative_max_running
    # Touch every KV page once now: a run that first writes fresh pages pays page faults the other does not.
    engine.runner.kv_cache.zero_()
    tok = engine.tokenizer
    encoded = {c: [tok.encode_chat([{"role": "user", "content": t}]) for t in texts] for c, texts in PROMPTS.items()}
    for spec in (False, True):  # warm-up: page in the weights, build the kernels' per-shape state
        run(engine, [encoded["repeat_fix"][0], encoded["free_chat"][0]],
            SamplingParams(max_tokens=32, temperature=0, speculative=spec))
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    print(f"single stream, {args.max_tokens} tokens, median of {args.reps} (interleaved off/on):")
    single = single_stream(engine, encoded, args.max_tokens, args.reps)
    mixed = [p for c in PROMPTS for p in encoded[c]]
    print(f"{args.streams} concurrent streams, {args.stream_tokens} tokens each:")
    multi = [concurrent(engine, mixed, args.streams, args.stream_tokens, args.reps, c)
             for c in (default_cutoff, 1 << 30)]
    # Where does speculating on every stream stop paying? Formatted prompts, the cutoff lifted.
    formatted = [p for c in FORMATTED for p in encoded[c]]
    print(f"sweep: formatted prompts, cutoff lifted, {args.stream_tokens} tokens each:")
    sweep = [concurrent(engine, formatted, int(n), args.stream_tokens, args.reps, 1 << 30)
             for n in args.sweep.split(",") if n]
    engine.speculation.max_running = default_cutoff

    def summary(cats: tuple[str, ...]) -> dict:
        rows = [r for r in single if r["category"] in cats]
        prop = sum(r["proposed"] for r in rows)
        acc = sum(r["accepted"] for r in rows)
        steps = sum(r["verify_steps"] for r in rows)
        return dict(speedup_median=round(statistics.median(r["speedup"] for r in rows), 3),
                    speedup_min=min(r["speedup"] for r in rows), acceptance=round(acc / prop, 3) if prop else None,
                    mean_accepted_len=round(acc / steps, 2) if steps else None,
                    identical=all(r["identical"] for r in rows))

    result = dict(
        model="smollm2", weight_format=engine.weight_format, threads=args.threads, proposer=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens, default_speculative_max_running=default_cutoff,
        max_tokens=args.max_tokens, reps=args.reps, single_stream=single, concurrent=multi, sweep=sweep,
        formatted=summary(FORMATTED), free_chat=summary(("free_chat",)),
        seconds=round(time.perf_counter() - t0, 1), load_average_start=round(load_start, 2),
        load_average_end=round(os.getloadavg()[0], 2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    print("\n| category | prompt | tokens | steps off / on | off tok/s | on tok/s | speedup | acceptance "
          "| mean accepted | identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in single:
        acc = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        mean = r["mean_accepted_len"] if r["verify_steps"] else "-"
        print(f"| {r['category']} | {r['prompt']} | {r['tokens']} | {r['off_steps']} / {r['on_steps']} | "
              f"{r['off_tps']} | {r['on_tps']} | {r['speedup']:.2f}x | {acc} | {mean} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    print("\n| streams | prompts | cutoff (max running) | off tok/s | on tok/s | ratio | verifications | identical |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for kind, rows in (("all", multi), ("formatted", sweep)):
        for m in rows:
            cutoff = "none" if m["speculative_max_running"] >= 1 << 30 else m["speculative_max_running"]
            print(f"| {m['streams']} | {kind} | {cutoff} | {m['off_tps']} | {m['on_tps']} | "
                  f"{m['ratio']:.2f}x | {m['verify_steps']} | {'yes' if m['identical'] else 'NO'} |")
    print(f"\nformatted: {result['formatted']}\nfree chat: {result['free_chat']}\n{result['seconds']} s; "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
