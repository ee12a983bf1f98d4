#!/usr/bin/env python
"""Prefix caching on multi-turn chat with a ~500-token shared system prompt: TTFT with and without, same run.

Two engines on the real model, identical but for --enable-prefix-caching, in one process (one thread pool). A set of
conversations share one system prompt; each turn sends the whole chat so far (system prompt, earlier questions and
the engine's own answers, rendered with the chat template as a server would), all conversations of a turn at once.
Turns are interleaved between the two engines (on, off, then off, on, ...) so that load on the machine hits both
alike. Before the measured turns each engine serves two warm-up requests with the system prompt, one after the other
(a service's system prompt is hot; without it the first turn's requests all arrive together and compute it side by
side).

TTFT is the engine's own: first token time - arrival (time.perf_counter at add_request), per request.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/prefix_cache.py    # writes benchmarks/results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tailguard.engine.engine import EngineArgs, LLMEngine, TokenEvent
from tailguard.engine.sequence import SamplingParams

SYSTEM_PROMPT = (
    "You are Velo, the customer assistant of Northwind Cycles, a bicycle shop with three stores and an online shop. "
    "Follow these rules in every answer. Be brief: at most three sentences unless the customer asks for detail. Be "
    "polite and plain; never use jargon without explaining it. Only talk about bicycles, their parts, accessories, "
    "repairs, rentals, prices, orders, deliveries and returns; for anything else, say kindly that you can only help "
    "with cycling matters. Never invent a price, a stock level or a delivery date: if you do not know, say so and "
    "offer to connect the customer with a store. Opening hours: Monday to Friday 9:00 to 19:00, Saturday 9:00 to "
    "17:00, closed on Sunday and public holidays. Stores: Harbour Street 12 (repairs and rentals), Market Square 3 "
    "(road and gravel bikes), Oak Avenue 48 (children's and city bikes, cargo bikes). Repairs: a basic service costs "
    "49 euros and takes two working days; a full service costs 119 euros and takes four working days; a flat tyre is "
    "fixed while you wait for 15 euros plus the tube. Rentals: city bikes 15 euros a day, e-bikes 35 euros a day, a "
    "deposit of 200 euros and an identity document are required. Returns: unused items within 30 days with the "
    "receipt; bicycles only if they have not been ridden outdoors. Deliveries: free above 100 euros, otherwise 6.90 "
    "euros, two to four working days; bicycles are delivered 90 percent assembled with the tools needed. Warranty: "
    "two years on all parts, five years on frames; wear parts such as tyres, chains, brake pads and cables are not "
    "covered. Safety: always recommend a helmet and lights when riding at night, and suggest a professional check "
    "when a customer mentions brakes that feel soft, a cracked frame or a wobbling wheel. When a customer asks which "
    "bike to buy, ask about their height, their budget and where they will ride before recommending anything. When "
    "a customer is unhappy, apologise once, summarise the problem in one sentence and offer a concrete next step. "
    "Sign nothing and do not add greetings at the end of your answers."
)

QUESTIONS = [
    ["My rear tyre keeps going flat, what should I do?", "How long would that take at your shop?",
     "Can I wait there while you do it?", "Do you also sell puncture-proof tyres?"],
    ["I want a bike to commute 10 km a day.", "My budget is about 800 euros.", "Is an e-bike worth it for that?",
     "Can I rent one first to try?"],
    ["How much is a full service?", "What does it include?", "Can you pick the bike up from my home?",
     "When are you open on Saturday?"],
    ["My brakes feel soft when I pull them.", "Is it safe to ride to the store?", "How much are new brake pads?",
     "Are they covered by the warranty?"],
    ["Do you have children's bikes for a six year old?", "She is about 115 cm tall.",
     "Which store has them?", "Do they come with training wheels?"],
    ["I received my bike but a pedal is missing.", "The order number is 48213.", "Can you send the pedal quickly?",
     "Or can I get a refund instead?"],
    ["What lights do you recommend for winter?", "Are rechargeable ones better?", "How long does a charge last?",
     "Do you deliver them for free?"],
    ["Can I return a helmet I bought last week?", "I lost the receipt.", "Can you find it with my card?",
     "Thank you, what are your opening hours?"],
]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_turn(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> list[list[TokenEvent]]:
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    events: dict[str, list[TokenEvent]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    return [events[rid] for rid in ids]


def load_average() -> float:
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8, help="conversations in flight together (at most 8)")
    ap.add_argument("--turns", type=int, default=4, help="measured turns per conversation (at most 4)")
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length per turn (greedy)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefix_cache.json"))
    args = ap.parse_args()
    if not 1 <= args.conversations <= len(QUESTIONS) or not 1 <= args.turns <= len(QUESTIONS[0]):
        ap.error(f"--conversations must be 1..{len(QUESTIONS)} and --turns 1..{len(QUESTIONS[0])}")

    load_before = load_average()
    common = dict(model=args.model, num_threads=args.threads, kv_cache_tokens=32768, max_num_batched_tokens=512,
                  max_prefill_chunk=256)
    engines = {"on": LLMEngine(EngineArgs(enable_prefix_caching=True, **common)),
               "off": LLMEngine(EngineArgs(enable_prefix_caching=False, **common))}
    tok = engines["on"].tokenizer
    system = [{"role": "system", "content": SYSTEM_PROMPT}]
    system_tokens = len(tok.encode(tok.render_chat(system, add_generation_prompt=False)))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for engine in engines.values():  # warm-up: the system prompt is hot in a running service; both prefill paths ran
        for greeting in ("Hello!", "Good morning!"):
            run_turn(engine, [tok.encode_chat(system + [{"role": "user", "content": greeting}])], sp)

    chats = {mode: [list(system) for _ in range(args.conversations)] for mode in engines}
    ttft: dict[str, list[float]] = {mode: [] for mode in engines}
    cached: dict[str, list[int]] = {mode: [] for mode in engines}
    prompt_lens: dict[str, list[int]] = {mode: [] for mode in engines}
    agree = total = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        order = ["on", "off"] if turn % 2 == 0 else ["off", "on"]
        answers: dict[str, list[list[int]]] = {}
        for mode in order:
            msgs = chats[mode]
            for c in range(args.conversations):
                msgs[c].append({"role": "user", "content": QUESTIONS[c][turn]})
            prompts = [tok.encode_chat(m) for m in msgs]
            results = run_turn(engines[mode], prompts, sp)
            answers[mode] = []
            for c, events in enumerate(results):
                final = events[-1]
                ttft[mode].append(final.first_token - final.arrival)
                cached[mode].append(final.num_cached_tokens)
                prompt_lens[mode].append(final.num_prompt_tokens)
                out = [ev.token_id for ev in events if ev.token_id is not None]
                answers[mode].append(out)
                msgs[c].append({"role": "assistant", "content": tok.decode(out)})
            print(f"turn {turn + 1} {mode:>3}: TTFT P50 {percentile(ttft[mode][-args.conversations:], 50) * 1e3:7.1f} "
                  f"ms, prompts {min(prompt_lens[mode][-args.conversations:])}-"
                  f"{max(prompt_lens[mode][-args.conversations:])} tokens", flush=True)
        for a, b in zip(answers["on"], answers["off"]):
            agree += a == b
            total += 1
    wall = time.perf_counter() - t0
    load_after = load_average()

    summary = {}
    for mode, values in ttft.items():
        stats = engines[mode].stats()
        summary[mode] = {
            "requests": len(values),
            "ttft_p50_ms": percentile(values, 50) * 1e3,
            "ttft_p90_ms": percentile(values, 90) * 1e3,
            "ttft_p99_ms": percentile(values, 99) * 1e3,
            "ttft_mean_ms": statistics.fmean(values) * 1e3,
            "prompt_tokens_mean": statistics.fmean(prompt_lens[mode]),
            "cached_tokens_mean": statistics.fmean(cached[mode]),
            "hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
        }
    ratio = {q: summary["off"][f"ttft_{q}_ms"] / summary["on"][f"ttft_{q}_ms"] for q in ("p50", "p90", "p99", "mean")}
    print(f"\n{'':>22} {'cache off':>10} {'cache on':>10} {'ratio':>7}")
    for q in ("p50", "p90", "p99", "mean"):
        print(f"{'TTFT ' + q + ' (ms)':>22} {summary['off'][f'ttft_{q}_ms']:10.1f} {summary['on'][f'ttft_{q}_ms']:10.1f} "
              f"{ratio[q]:6.1f}x")
    print(f"{'prompt tokens (mean)':>22} {summary['off']['prompt_tokens_mean']:10.0f} "
          f"{summary['on']['prompt_tokens_mean']:10.0f}")
    print(f"{'cached tokens (mean)':>22} {summary['off']['cached_tokens_mean']:10.0f} "
          f"{summary['on']['cached_tokens_mean']:10.0f}")
    print(f"{'hit rate (tokens)':>22} {summary['off']['hit_rate']:10.1%} {summary['on']['hit_rate']:10.1%}")
    print(f"identical answers: {agree}/{total}; wall {wall:.0f} s; load average {load_before:.2f} -> {load_after:.2f}")
    result = {
        "benchmark": "prefix_cache",
        "model": args.model,
        "weight_format": engines["on"].weight_format,
        "device": str(engines["on"].device),
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "conversations": args.conversations,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "system_prompt_tokens": system_tokens,
        "summary": summary,
        "ratio_off_over_on": ratio,
        "identical_answers": agree,
        "answers_compared": total,
        "ttft_s": ttft,
        "wall_s": wall,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
