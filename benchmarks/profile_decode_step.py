#!/usr/bin/env python
"""Where the time of one tailguard decode step goes (single stream and N streams).

Two passes over the same steady decode steps, without touching the engine code (functions are wrapped from here):

1. wall-clock phases with perf_counter wrappers (cheap, no profiler): scheduler.schedule, runner._build (batch and
   attention metadata), model.forward (split into the 30 layers and the LM head), runner.sample, and the post-processing
   (detokenize, stop checks, events);
2. torch.profiler on the same kind of steps: the top-level aten ops of the forward pass grouped into matmuls, LM head,
   attention (SDPA), KV gather (index into the paged cache), KV write (index_copy_), norms, elementwise/RoPE/copies.
   "python + dispatch" is the forward wall time of pass 1 minus the op time of pass 2 (a lower bound: the profiler
   inflates op times a little).

Usage::

    python benchmarks/profile_decode_step.py                       # float32, 1 and 16 streams, 2 threads
    python benchmarks/profile_decode_step.py --formats float32,int8,bfloat16 --streams 1,16,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from engine_throughput import (
    CHAT_PROMPTS as PROMPTS,  # the same chat prompts as the throughput run (sibling script)
)
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile, record_function

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

console = Console(width=None if sys.stdout.isatty() else 150)


MATMUL_OPS = {"aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "quantized::linear_dynamic"}
ELEMENTWISE_OPS = {
    "aten::cat", "aten::neg", "aten::mul", "aten::add", "aten::silu", "aten::copy_", "aten::chunk", "aten::slice",
    "aten::select", "aten::empty", "aten::to", "aten::_to_copy", "aten::float", "aten::view", "aten::transpose",
    "aten::unsqueeze", "aten::squeeze", "aten::split", "aten::narrow", "aten::as_strided", "aten::fill_",
}


class Timer:
    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn, label: str | None = None):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            if label:
                with record_function(label):
                    r = fn(*a, **k)
            else:
                r = fn(*a, **k)
            self.acc[name] += time.perf_counter() - t0
            return r

        return wrapped


class _Head:
    """Stand-in for model.lm_head that times it (Linear.__call__ is looked up on the class, so wrap the object)."""

    def __init__(self, inner, timer: Timer) -> None:
        self.inner, self.timer = inner, timer

    def __call__(self, x):
        t0 = time.perf_counter()
        with record_function("lm_head"):
            r = self.inner(x)
        self.timer.acc["lm_head"] += time.perf_counter() - t0
        return r


def instrument(engine: LLMEngine, timer: Timer) -> None:
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule, "schedule")
    engine.runner._build = timer.wrap("build_batch", engine.runner._build, "build_batch")
    engine.model.forward = timer.wrap("forward", engine.model.forward, "forward")
    engine.runner.sample = timer.wrap("sample", engine.runner.sample, "sample")
    engine._post_process = timer.wrap("post_process", engine._post_process, "post_process")
    engine.model.lm_head = _Head(engine.model.lm_head, timer)


def start_streams(engine: LLMEngine, n: int, max_tokens: int) -> None:
    tok = engine.tokenizer
    for i in range(n):
        ids = tok.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    # Step until every stream is decoding.
    while not (engine.scheduler.num_waiting == 0 and all(s.in_decode for s in engine.scheduler.running)):
        engine.step()


def classify(ev) -> str:
    name = ev.name
    if name in MATMUL_OPS:
        return "matmul (layers)"
    if name == "aten::scaled_dot_product_attention":
        return "attention (SDPA)"
    if name == "aten::index":
        shapes = getattr(ev, "input_shapes", None) or []
        if shapes and len(shapes[0]) == 3:
            return "KV gather (index)"
        return "embed/RoPE table lookup"
    if name == "aten::index_copy_":
        return "KV write (index_copy_)"
    if name == "aten::rms_norm":
        return "rms_norm"
    if name in ELEMENTWISE_OPS:
        return "elementwise/RoPE/copies"
    return "other ops (" + name + ")"


def profile_ops(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Per-step microseconds of the top-level ops inside forward, grouped; plus region totals."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
    per_cat: dict[str, float] = defaultdict(float)
    regions = {"forward", "lm_head", "sample", "build_batch", "schedule", "post_process"}
    for ev in prof.events():
        parent = ev.cpu_parent
        if parent is None or parent.name not in regions:
            continue
        # Top-level op of a region: an op whose parent is the region itself.
        if ev.name in regions:
            continue
        region = parent.name
        dur = ev.cpu_time_total  # inclusive of its children, in us
        if region == "forward":
            per_cat[classify(ev)] += dur
        elif region == "lm_head":
            per_cat["LM head matmul"] += dur
        else:
            per_cat[f"ops in {region}"] += dur
    return {k: v / steps for k, v in per_cat.items()}


def run_case(fmt: str, n: int, threads: int, steps: int) -> dict:
    engine = LLMEngine(
        EngineArgs(weight_format=fmt, num_threads=threads, kv_cache_tokens=max(4096, n * 512), max_num_seqs=max(64, n),
                   kv_cache_dtype="float16", runner="torch")
    )
    torch.set_num_threads(threads)
    start_streams(engine, n, max_tokens=3 * steps + 40)
    for _ in range(10):  # warm-up decode steps
        engine.step()
    timer = Timer()
    instrument(engine, timer)
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    total = sum(step_times)
    phases_ms = {k: 1000 * v / steps for k, v in timer.acc.items()}
    ops_us = profile_ops(engine, steps)
    fwd_wall_ms = phases_ms["forward"] - phases_ms["lm_head"]  # the 30 layers + embedding + final norm
    fwd_ops_ms = sum(v for k, v in ops_us.items()) / 1000 - ops_us.get("LM head matmul", 0) / 1000 - sum(
        v for k, v in ops_us.items() if k.startswith("ops in ")
    ) / 1000
    # The profiler makes ops slower; scale op shares to the unprofiled forward wall time when the sum exceeds it.
    scale = min(1.0, fwd_wall_ms / fwd_ops_ms) if fwd_ops_ms else 1.0
    step_ms = 1000 * total / steps
    breakdown = {}
    for k, v in sorted(ops_us.items(), key=lambda kv: -kv[1]):
        if k.startswith("ops in ") or k == "LM head matmul":
            continue
        breakdown[k] = v / 1000 * scale
    breakdown["python + dispatch in forward (gap)"] = max(0.0, fwd_wall_ms - fwd_ops_ms * scale)
    breakdown["LM head"] = phases_ms.get("lm_head", 0.0)
    breakdown["sampling (runner.sample)"] = phases_ms.get("sample", 0.0)
    breakdown["batch build (runner._build)"] = phases_ms.get("build_batch", 0.0)
    breakdown["scheduler.schedule"] = phases_ms.get("schedule", 0.0)
    breakdown["post-process (detok, stops, events)"] = phases_ms.get("post_process", 0.0)
    accounted = sum(breakdown.values())
    breakdown["rest of step (engine.step glue)"] = max(0.0, step_ms - accounted)
    return {
        "format": fmt,
        "streams": n,
        "threads": threads,
        "steps": steps,
        "step_ms_median": 1000 * statistics.median(step_times),
        "step_ms_mean": step_ms,
        "tokens_per_s": n / (total / steps),
        "phases_ms": phases_ms,
        "breakdown_ms": breakdown,
        "breakdown_pct": {k: 100 * v / step_ms for k, v in breakdown.items()},
        "forward_ops_profiled_ms": fwd_ops_ms,
        "profiler_scale": scale,
    }


def main() -> int:
    p = argparse.ArgumentParser(description="Profile one tailguard decode step")
    p.add_argument("--formats", default="float32")
    p.add_argument("--streams", default="1,16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--output", default="benchmarks/results/profile_decode_step.json")
    a = p.parse_args()
    results = []
    for fmt in a.formats.split(","):
        for n in (int(x) for x in a.streams.split(",")):
            console.print(f"profiling {fmt} x{n} ...")
            r = run_case(fmt, n, a.threads, a.steps)
            results.append(r)
            t = Table(title=f"tailguard {fmt}, {n} stream(s): {r['step_ms_mean']:.1f} ms/step, "
                      f"{r['tokens_per_s']:.1f} tok/s")
            t.add_column("where")
            t.add_column("ms/step", justify="right")
            t.add_column("%", justify="right")
            for k, v in sorted(r["breakdown_ms"].items(), key=lambda kv: -kv[1]):
                t.add_row(k, f"{v:.2f}", f"{r['breakdown_pct'][k]:.1f}")
            console.print(t)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
