"""What tokenizing a prompt costs, per language, and what batching concurrent arrivals buys.

1. **Per language.** Each text is encoded by the server's tokenizer (``GGUFTokenizer.encode`` with its prompt cache
   off, so that every call encodes) ``--repeats`` times; the table gives medians per call, per character and per
   token. Texts: the shipped held-out texts (``benchmarks/data/heldout_{en,zh}.txt``), a short medical case in
   English and in Chinese (``benchmarks/data/medical_{en,zh}.txt``, written for this benchmark) and the pair
   "深度学习" / "deep learning" (a circulating claim has them at 12 ms against 2.3 ms). Two states of the Rust BPE
   model's own word cache: **warm** (the text was seen before: its words are cached, as in a server that has run a
   while) and **cold** (the word cache cleared before every call: words never seen). A glossary term's answer from
   the pinned cache is timed beside its encode.
2. **Concurrent arrivals.** ``--arrivals`` prompts of 200-2,000 characters (English, Chinese, medical), all
   arriving at once on an asyncio loop, tokenized (a) one by one on the loop (the server's former path for prompts
   up to 4,096 characters), (b) one by one on a worker thread, (c) by the server's batcher
   (``serving/tokenize_pipeline.py``) with no window and (d) with a 1 ms window; plus the same prompts arriving
   100 us apart. Rounds interleave the variants; per round: the time the last prompt got its ids, each prompt's
   wait, and the longest the loop was held (a 0.2 ms heartbeat's worst lateness). Medians over rounds.
3. **A lone prompt**: encoded on the loop against sent to the batcher's thread, by size: where the thread hop
   starts to pay (the batcher's ``tokenize_inline_chars``).

    python benchmarks/tokenize_cost.py              # ~4 minutes; results/tokenize_cost.json
    python benchmarks/tokenize_cost.py --quick      # a smoke run, results to a temporary file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data"
CLAIM = {"深度学习": 12.0, "deep learning": 2.3}  # ms, as claimed


def _run(coro: Any) -> None:
    """On uvloop, the server's event loop, where it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def _median_us(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    xs = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def per_language(plain: Any, texts: dict[str, str], repeats: int, short_repeats: int) -> dict[str, dict]:
    """Rounds that take every text in turn (outside load then hits them all alike): cold, then warm."""
    model = plain._tok.model
    warm: dict[str, list[float]] = {name: [] for name in texts}
    cold: dict[str, list[float]] = {name: [] for name in texts}
    for r in range(max(repeats, short_repeats)):
        now = {name: text for name, text in texts.items() if r < (short_repeats if len(text) < 100 else repeats)}
        for name, text in now.items():
            model._clear_cache()
            t0 = time.perf_counter()
            plain.encode(text)
            cold[name].append(time.perf_counter() - t0)
        for text in now.values():  # every text's words back in the word cache (the last clear left one's)
            plain.encode(text)
        for name, text in now.items():
            t0 = time.perf_counter()
            plain.encode(text)
            warm[name].append(time.perf_counter() - t0)
    model._clear_cache()
    rows: dict[str, dict] = {}
    for name, text in texts.items():
        n = len(plain.encode(text))
        w, c = statistics.median(warm[name]) * 1e6, statistics.median(cold[name]) * 1e6
        rows[name] = {"chars": len(text), "utf8_bytes": len(text.encode()), "tokens": n,
                      "tokens_per_char": n / len(text), "repeats": len(warm[name]),
                      "warm_us": w, "warm_ns_per_char": w * 1000 / len(text), "warm_ns_per_token": w * 1000 / n,
                      "cold_us": c, "cold_ns_per_char": c * 1000 / len(text), "cold_ns_per_token": c * 1000 / n}
        print(f"{name:>16} {len(text):6d} chars {n:6d} tok {n / len(text):5.2f} tok/char | warm {w:9.1f} us "
              f"{w * 1000 / len(text):6.0f} ns/char {w * 1000 / n:6.0f} ns/tok | cold {c:9.1f} us "
              f"{c * 1000 / len(text):6.0f} ns/char {c * 1000 / n:6.0f} ns/tok", flush=True)
    return rows


def glossary_cost(tok: Any, plain: Any, terms: list[str], repeats: int) -> dict[str, Any]:
    """A pinned term's answer (the cache's lookup) against encoding it, cold and warm."""
    tok.set_glossary(terms)
    model = plain._tok.model
    lookup = statistics.median(_median_us(lambda t=t: tok.lookup(t), repeats) for t in terms)
    warm = statistics.median(_median_us(lambda t=t: plain.encode(t), repeats) for t in terms)
    cold = statistics.median(_median_us(lambda t=t: plain.encode(t), repeats, before=model._clear_cache)
                             for t in terms)
    same = all(tok.encode(t) == plain.encode(t) for t in terms)
    tok.set_glossary([])
    print(f"glossary ({len(terms)} terms): pinned lookup {lookup:.2f} us, encode warm {warm:.2f} us, cold "
          f"{cold:.2f} us; same ids: {same}", flush=True)
    return {"terms": len(terms), "lookup_us": lookup, "encode_warm_us": warm, "encode_cold_us": cold,
            "same_ids": same}


def arrival_texts(sources: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        src = rng.choice(sources) * 4
        size = rng.randint(200, 2000)
        start = rng.randint(0, len(src) - size - 1)
        out.append(src[start:start + size])
    return out


async def _round(variant: str, tok: Any, texts: list[str], spacing_s: float, busy: bool) -> dict[str, float]:
    from tailguard.serving.tokenize_pipeline import TokenizeBatcher

    stop = False
    held = [0.0]

    async def heartbeat() -> None:
        """Idle: wakes every 1 ms (the loop waits in epoll between, GIL released). Busy: 100 us of Python, then
        yields, again and again, as a loop serving many streams does. Either way: its worst gap beyond that."""
        period = 0.0001 if busy else 0.001
        last = time.perf_counter()
        while not stop:
            if busy:
                end = last + period
                while time.perf_counter() < end:
                    pass
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(period)
            now = time.perf_counter()
            held[0] = max(held[0], now - last - period)
            last = now

    batcher = None
    if variant.startswith("batcher"):
        batcher = TokenizeBatcher(tok, window_s=0.001 if variant == "batcher 1ms" else 0.0, inline_chars=256)
    one = asyncio.Semaphore(1)

    async def encode(text: str) -> list[int]:
        if variant == "loop":
            return tok.encode(text)
        if variant == "thread":
            async with one:
                return await asyncio.to_thread(tok.encode, text)
        assert batcher is not None
        return await batcher.encode(text)

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.003)
    held[0] = 0.0
    t0 = time.perf_counter()
    waits: list[float] = []

    async def arrive(i: int, text: str) -> None:
        if spacing_s:
            await asyncio.sleep(i * spacing_s)
        await encode(text)
        # From its arrival: on the loop, a prompt also waits for the ones encoded before it.
        waits.append(time.perf_counter() - (t0 + i * spacing_s))

    await asyncio.gather(*(arrive(i, t) for i, t in enumerate(texts)))
    makespan = time.perf_counter() - t0
    stop = True
    await beat
    if batcher is not None:
        batcher.close()
    waits.sort()
    return {"makespan_ms": makespan * 1000, "wait_p50_ms": statistics.median(waits) * 1000,
            "wait_max_ms": waits[-1] * 1000, "loop_held_max_ms": held[0] * 1000,
            "batches": batcher.batches + batcher.inline if batcher is not None else len(texts)}


def concurrent(tok: Any, texts: list[str], rounds: int, spacing_s: float, busy: bool) -> dict[str, dict]:
    variants = ["loop", "thread", "batcher", "batcher 1ms"]
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}

    async def main() -> None:
        for _ in range(rounds):
            for v in variants:  # interleaved: outside load hits them alike
                got[v].append(await _round(v, tok, texts, spacing_s, busy))

    _run(main())
    out = {}
    for v, rs in got.items():
        out[v] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        m = out[v]
        print(f"  {v:>12}: last ids {m['makespan_ms']:7.2f} ms, wait P50 {m['wait_p50_ms']:7.2f} ms, max "
              f"{m['wait_max_ms']:7.2f} ms, loop held {m['loop_held_max_ms']:6.2f} ms, batches {m['batches']:.0f}",
              flush=True)
    return out


def raw_batch(tok: Any, texts: list[str], repeats: int) -> dict[str, float]:
    seq = bat = 0.0
    seqs, bats = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for t in texts:
            tok.encode(t)
        seqs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tok.encode_batch(texts)
        bats.append(time.perf_counter() - t0)
    seq, bat = statistics.median(seqs) * 1000, statistics.median(bats) * 1000
    print(f"  no event loop: one by one {seq:.2f} ms, encode_batch {bat:.2f} ms ({seq / bat:.2f}x)", flush=True)
    return {"one_by_one_ms": seq, "encode_batch_ms": bat, "speedup": seq / bat}


def lone_prompt(tok: Any, source: str, sizes: list[int], repeats: int) -> dict[str, dict]:
    """Encoding on the loop (what it holds the loop, and the prompt's wait) against the batcher's thread (the
    prompt's wait: the encode plus the hop there and back)."""
    from tailguard.serving.tokenize_pipeline import TokenizeBatcher

    out: dict[str, dict] = {}

    async def main() -> None:
        thread = TokenizeBatcher(tok, inline_chars=0)
        for size in sizes:
            text = (source * (1 + size // len(source)))[:size]
            a, b = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                tok.encode(text)
                a.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await thread.encode(text)
                b.append(time.perf_counter() - t0)
            row = out[str(size)] = {"loop_us": statistics.median(a) * 1e6, "thread_us": statistics.median(b) * 1e6}
            row["hop_us"] = row["thread_us"] - row["loop_us"]
            print(f"  {size:5d} chars: on the loop {row['loop_us']:7.1f} us, via the thread {row['thread_us']:7.1f} "
                  f"us (hop {row['hop_us']:5.1f} us)", flush=True)
        thread.close()

    _run(main())
    return out


def concurrent_all(tok: Any, burst: list[str], rounds: int) -> dict[str, Any]:
    conc: dict[str, Any] = {}
    default_switch = sys.getswitchinterval()
    for busy, switch in ((False, default_switch), (True, default_switch), (True, 0.0002)):
        sys.setswitchinterval(switch)  # how soon a thread waiting for the GIL gets it from a busy loop
        for spacing, label in ((0.0, "at once"), (0.0001, "100 us apart")):
            key = f"{'busy' if busy else 'idle'} loop, {label}, switch interval {switch * 1000:g} ms"
            print(f"   {key}", flush=True)
            conc[key] = concurrent(tok, burst, rounds, spacing, busy)
    sys.setswitchinterval(default_switch)
    return conc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1000, help="encodes per paragraph-sized text")
    ap.add_argument("--short-repeats", type=int, default=5000, help="encodes per short text (the word pair)")
    ap.add_argument("--arrivals", type=int, default=16, help="prompts arriving at once")
    ap.add_argument("--rounds", type=int, default=60, help="rounds of each concurrent variant")
    ap.add_argument("--quick", action="store_true", help="few repeats, results to a temporary file")
    ap.add_argument("--concurrent-only", action="store_true", help=argparse.SUPPRESS)  # the child run
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "tokenize_cost.json")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.short_repeats, args.rounds = 20, 200, 4
        if not args.concurrent_only:
            args.out = Path(tempfile.mkdtemp(prefix="tokenize_cost_")) / "tokenize_cost.json"

    from tailguard.engine.model_store import resolve_model_path
    from tailguard.engine.tokenizer import GGUFTokenizer
    from tailguard.serving.tokenize_pipeline import read_terms

    path = resolve_model_path("smollm2")
    plain = GGUFTokenizer(path, cache_size=0)  # every call encodes
    tok = GGUFTokenizer(path, cache_size=0)  # the batcher's (its prompt cache off too: every round encodes)
    read = {name: (DATA / f"{name}.txt").read_text(encoding="utf-8").strip()
            for name in ("heldout_en", "heldout_zh", "medical_en", "medical_zh")}
    burst = arrival_texts(list(read.values()), args.arrivals, seed=7)
    if args.concurrent_only:  # TOKENIZERS_PARALLELISM=false, set by the parent
        args.out.write_text(json.dumps(concurrent_all(tok, burst, args.rounds)), encoding="utf-8")
        return
    texts = {**read, "deep learning": "deep learning", "深度学习": "深度学习"}
    load = os.getloadavg()

    print("1. per language (GGUFTokenizer.encode, prompt cache off)")
    rows = per_language(plain, texts, args.repeats, args.short_repeats)
    ratios = {}
    for a, b in (("heldout_zh", "heldout_en"), ("medical_zh", "medical_en"), ("深度学习", "deep learning")):
        ratios[f"{a} / {b}"] = {k: rows[a][k] / rows[b][k] for k in
                                ("warm_ns_per_char", "warm_ns_per_token", "cold_ns_per_char", "cold_ns_per_token",
                                 "warm_us", "cold_us")}
    claim = {w: {"claimed_ms": ms, "measured_cold_ms": rows[w]["cold_us"] / 1000,
                 "measured_warm_ms": rows[w]["warm_us"] / 1000, "tokens": rows[w]["tokens"]} for w, ms in CLAIM.items()}
    print(f"   the claim: 深度学习 12 ms vs deep learning 2.3 ms; measured (cold) "
          f"{claim['深度学习']['measured_cold_ms'] * 1000:.1f} us vs "
          f"{claim['deep learning']['measured_cold_ms'] * 1000:.1f} us")
    glossary = glossary_cost(tok, plain, read_terms(DATA / "medical_glossary.txt"), max(1, args.short_repeats // 10))

    print(f"2. {args.arrivals} prompts of 200-2,000 characters ({sum(map(len, burst)):,} in all)")
    conc = concurrent_all(tok, burst, args.rounds)
    raw = raw_batch(tok, burst, args.rounds)
    print("   again, with TOKENIZERS_PARALLELISM=false (encode_batch on its calling thread alone), in a child process",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        child = Path(tmp) / "concurrent.json"
        argv = [sys.executable, __file__, "--concurrent-only", "--out", str(child), "--rounds", str(args.rounds),
                "--arrivals", str(args.arrivals)]
        subprocess.run(argv, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        one_core = json.loads(child.read_text(encoding="utf-8"))
    print("3. a lone prompt: on the loop or via the batcher's thread (English, medians)")
    lone = lone_prompt(tok, read["heldout_en"], [50, 100, 200, 400, 800, 1600, 3200], args.repeats)

    result = {
        "platform": {"python": platform.python_version(), "machine": platform.machine(),
                     "processor": platform.processor(), "cpus": os.cpu_count(), "load_avg_at_start": load,
                     "load_avg_at_end": os.getloadavg(), "tokenizers": __import__("tokenizers").__version__},
        "config": {"repeats": args.repeats, "short_repeats": args.short_repeats, "arrivals": args.arrivals,
                   "rounds": args.rounds, "quick": args.quick, "argv": sys.argv[1:]},
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "per_language": rows, "ratios": ratios, "claim": claim, "glossary": glossary,
        "concurrent": {**conc, "no_event_loop": raw, "prompt_chars": [len(t) for t in burst]},
        "concurrent_parallelism_off": one_core,
        "lone_prompt": lone,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
