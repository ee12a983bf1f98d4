#!/usr/bin/env python
"""Several choices of one prompt: one request with ``n`` against ``n`` requests sent at once, on the real model.

The embedded engine answers a request with ``n`` choices as ``n`` sequences, the later ones admitted once the first
has its prompt in the prefix cache, so that they take its KV blocks instead of computing the prompt again. What a
client does without ``n`` is send ``n`` requests at once (seeds ``s .. s+n-1``: the same answers): their prompts are
computed side by side. Each round sends a fresh prompt (a number at its start, so no earlier round's cache helps) both
ways, alternating which goes first; the figures are medians over rounds: the client's end-to-end time for all
choices, its time to the first token of any choice (streamed), and the prompt tokens the engine computed (its prefix
cache's queries less hits).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/choices.py      # ~2 min; writes benchmarks/results/choices.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

RESULTS = Path(__file__).resolve().parent / "results" / "choices.json"
TEXT = ("The lighthouse stood at the end of a long breakwater, and its keeper climbed the stairs each evening to "
        "light the lamp, counting the steps as his father had counted them before him. ")


def _stream(client: openai.OpenAI, prompt: str, n: int, seed: int, max_tokens: int) -> tuple[float, float]:
    """(time to the first token of any choice, end to end) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], n=n, seed=seed, max_tokens=max_tokens,
            temperature=1.0, stream=True, extra_body={"ignore_eos": True}):
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompt-repeats", type=int, default=28, help="copies of the sentence (~34 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()

    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs
    from tailguard.serving.config import ServerConfig
    from tailguard.serving.server import ThreadedServer

    engine = AsyncLLMEngine.from_args(EngineArgs(model="smollm2", max_num_seqs=16, max_num_batched_tokens=512))
    store = Path(tempfile.mkdtemp(prefix="choices-")) / "store.sqlite3"
    cfg = ServerConfig(model="smollm2", port=0, store_path=str(store), access_log=False, log_level="warning")
    arms: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "e2e": [], "computed": []}
                                                for k in ("n_request", "separate_requests")}
    with ThreadedServer(cfg, engine) as srv, ThreadPoolExecutor(args.n) as pool:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
        _stream(client, "warm up", 1, 0, 4)
        for r in range(args.rounds):
            order = ["n_request", "separate_requests"][:: 1 if r % 2 == 0 else -1]
            for arm in order:
                prompt = f"Story {r}-{arm}. " + TEXT * args.prompt_repeats
                before = engine.stats()
                if arm == "n_request":
                    ttft, e2e = _stream(client, prompt, args.n, 100 * r, args.max_tokens)
                else:
                    t0 = time.perf_counter()
                    futs = [pool.submit(_stream, client, prompt, 1, 100 * r + i, args.max_tokens)
                            for i in range(args.n)]
                    got = [f.result() for f in futs]
                    ttft, e2e = min(g[0] for g in got), time.perf_counter() - t0
                after = engine.stats()
                computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (
                    after.prefix_cache_hits - before.prefix_cache_hits)
                arms[arm]["ttft"].append(ttft)
                arms[arm]["e2e"].append(e2e)
                arms[arm]["computed"].append(computed)
                print(f"round {r + 1}/{args.rounds} {arm}: TTFT {ttft * 1e3:.0f} ms, E2E {e2e * 1e3:.0f} ms, "
                      f"prompt tokens computed {computed}", flush=True)
    med = {arm: {k: statistics.median(v) for k, v in figs.items()} for arm, figs in arms.items()}
    a, b = med["n_request"], med["separate_requests"]
    print(f"\n| n = {args.n}, {args.max_tokens} tokens each | one request with n | {args.n} requests at once | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| prompt tokens computed | {a['computed']:.0f} | {b['computed']:.0f} | {a['computed'] / b['computed']:.2f} |")
    print(f"| first token of any choice | {a['ttft'] * 1e3:.0f} ms | {b['ttft'] * 1e3:.0f} ms | "
          f"{a['ttft'] / b['ttft']:.2f} |")
    print(f"| all choices done (E2E) | {a['e2e'] * 1e3:.0f} ms | {b['e2e'] * 1e3:.0f} ms | {a['e2e'] / b['e2e']:.2f} |")
    out: dict[str, Any] = {"benchmark": "choices", "machine": platform.processor() or platform.machine(),
                           "args": vars(args), "medians": med, "rounds": arms,
                           "date": time.strftime("%Y-%m-%d")}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
