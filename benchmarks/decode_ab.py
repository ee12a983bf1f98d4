#!/usr/bin/env python
"""Single-stream greedy decode rate of one engine build, for A/B runs of an engine change.

Prints the median of 5 generations of 64 tokens (after a 42-token chat prompt, prefill included), and with a third
argument N the median of 3 generations of 64 tokens for N prompts at once (N streams decoding together). To compare a
change with the code before it, copy the old ``src/tailguard`` somewhere and alternate::

    git archive OLD src/tailguard | tar -x -C /tmp/old_src
    PYTHONPATH=/tmp/old_src/src python benchmarks/decode_ab.py auto 2 16   # before
    python benchmarks/decode_ab.py auto 2 16                               # after
"""

import statistics
import sys
import time

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams


def main() -> None:
    fmt, threads = sys.argv[1], int(sys.argv[2])
    eng = LLMEngine(EngineArgs(model="smollm2", weight_format=fmt, num_threads=threads))
    prompt = "Write a short story about a robot who learns to paint."
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    greedy = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
    eng.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        eng.generate([ids], greedy)
        rates.append(64 / (time.perf_counter() - t))
    print(f"{fmt}, {threads} threads: {statistics.median(rates):.1f} tokens/s (median of 5, prefill included)")
    if len(sys.argv) > 3:
        n = int(sys.argv[3])
        prompts = [eng.tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
                   for i in range(n)]
        many = []
        for _ in range(3):
            t = time.perf_counter()
            eng.generate(prompts, greedy)
            many.append(n * 64 / (time.perf_counter() - t))
        print(f"{fmt}, {threads} threads, {n} streams: {statistics.median(many):.1f} tokens/s (median of 3)")


if __name__ == "__main__":
    main()
