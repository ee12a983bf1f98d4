#!/usr/bin/env python
"""What a scheduler setting does to the trace's TTFT and ITL tails, free of this host's noise.

    .venv/bin/python benchmarks/schedule_replay.py --a prefill_overrun_tokens=0 --b prefill_overrun_tokens=64
    # ~2 min; writes benchmarks/results/schedule_replay.json

On a shared two-core VM the same server's TTFT P99 swings 2x between identical runs a few minutes apart, so a
scheduling change worth 10-20% can take dozens of paired serving runs to show. This separates the two questions:

1. **What a step costs here.** The real engine (SmolLM2, default settings) steps through a random mix of prompts
   (16-1,500 tokens) and decodes, every step timed, and a model is fitted to the times: seconds = a fixed part + a
   part for steps that read the weights' bfloat16 tiles (prompt rows, or enough decode rows to run them there) + per
   decode row (on the block kernels, or on the tiles) + per thousand keys decode rows attend to + per prompt token +
   per thousand keys prompt rows attend to (least squares on relative errors, coefficients non-negative). The fit's
   median error is printed.
2. **What the scheduler does with it.** The conv trace's requests (lengths x 0.125 and the chat template's 30
   tokens, as ``vs_vllm.py`` sends them) arrive as a Poisson process and go through the engine's real ``Scheduler``
   and KV block pool in virtual time, each step lasting what the model says. Setting A and setting B see the same
   arrivals; every figure is exact for the model, so a difference between them is the setting's, not the host's.

Settings are ``SchedulerConfig`` fields (``key=value``, several allowed). It prints TTFT P50/P99, ITL P99 and
steps per rate (the median over seeds), and the capacity: the highest rate whose TTFT P99 stays within 1 s. What it
leaves out: HTTP, tokenization and detokenization (the same for both settings), and the host's noise itself.
A serving run (``vs_vllm.py --tailguard-args``) checks the direction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from tailguard.bench.workloads import load_trace
from tailguard.engine.blocks import BlockPool
from tailguard.engine.engine import DECODE_ROWS_ON_AMX_TILES, EngineArgs
from tailguard.engine.scheduler import Scheduler, SchedulerConfig
from tailguard.engine.sequence import FinishReason, SamplingParams, Sequence
from tailguard.engine.step_cost import StepShape

OUT = Path(__file__).parent / "results" / "schedule_replay.json"
TERMS = ("fixed", "tile_step", "decode_rows_blocks", "decode_rows_tiles", "decode_kilokeys", "prompt_tokens",
         "prompt_kilokeys")
TEMPLATE_TOKENS = 30  # SmolLM2's chat template around a user message (vs_vllm.py measures it)
KV_TOKENS = 67_776  # the engine's default KV cache (768 MiB of int8)
ROWS_ON_TILES = DECODE_ROWS_ON_AMX_TILES  # from this many decode rows a step runs them on the matrix units


def terms(shape: StepShape) -> list[float]:
    """The counts a step's time is modelled on. A step with prompt rows, or with enough decode rows to run them on
    the matrix units, reads the weights' bfloat16 tiles once (tile_step); decode rows cost differently on the block
    kernels and on the tiles."""
    rows = shape.decode_rows
    on_tiles = ROWS_ON_TILES > 0 and rows >= ROWS_ON_TILES
    return [1.0, float(shape.prefill_tokens > 0 or on_tiles), 0.0 if on_tiles else rows, rows if on_tiles else 0.0,
            shape.decode_keys / 1e3, shape.prefill_tokens, shape.prefill_keys / 1e3]


# --- 1. the step costs ---------------------------------------------------------------------------------------------


def measure_steps(steps: int, seed: int) -> list[tuple[StepShape, float]]:
    """The real engine's steps on a random mix of prompts and decodes: (shape, seconds) each."""
    from tailguard.engine.engine import LLMEngine

    engine = LLMEngine(EngineArgs(model="smollm2", enable_prefix_caching=False))
    sched = engine.scheduler
    rng = np.random.default_rng(seed)
    samples: list[tuple[StepShape, float]] = []
    # warm-up: first-use costs (buffers, tile packing) stay out of the fit
    engine.generate([rng.integers(100, 40000, size=600).tolist()], SamplingParams(max_tokens=4, temperature=0))
    while len(samples) < steps:
        # Arrivals at random steps, more often every other stretch: the batch wanders between idle and ~40 streams,
        # prompts between 16 and 1,500 tokens.
        busy = (len(samples) // 150) % 2 == 1
        if rng.random() < (0.3 if busy else 0.08) or not engine.has_unfinished():
            n = int(rng.choice([16, 64, 128, 256, 384, 511, 540, 700, 1024, 1500]) + rng.integers(0, 16))
            engine.add_request(rng.integers(100, 40000, size=n).tolist(),
                               SamplingParams(max_tokens=int(rng.integers(1, 80)), temperature=0, ignore_eos=True))
        sched.step_shape = None  # set again by the step's schedule (the shape of the step just run)
        t = time.perf_counter()
        engine.step()
        t = time.perf_counter() - t
        shape = sched.step_shape
        if shape is not None and shape.decode_rows + shape.prefill_tokens > 0:
            samples.append((shape, t))
        if len(samples) % 100 == 0 and samples:
            print(f"  {len(samples)}/{steps} steps timed", flush=True)
    return samples


def fit(samples: list[tuple[StepShape, float]]) -> tuple[dict[str, float], float]:
    """Non-negative least squares on relative errors; the coefficients and the fit's median relative error."""
    a = np.array([terms(s) for s, _ in samples])
    y = np.array([t for _, t in samples])
    coef, _ = nnls(a / y[:, None], np.ones_like(y))
    err = float(np.median(np.abs(a @ coef - y) / y))
    return dict(zip(TERMS, coef.tolist())), err


# --- 2. the replay ---------------------------------------------------------------------------------------------------


def trace_requests(rate: float, duration: float, seed: int, scale: float) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, output tokens): Poisson arrivals, the conv trace's lengths in its order."""
    rows = load_trace("conv")
    rng = np.random.default_rng(seed)
    out, t, i = [], 0.0, 0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t > duration:
            return out
        r = rows[i % len(rows)]
        i += 1
        out.append((t, max(1, round(r.input_tokens * scale)) + TEMPLATE_TOKENS, max(1, round(r.output_tokens * scale))))


def replay(requests: list[tuple[float, int, int]], config: dict, cost: Callable[[StepShape], float],
           warmup_s: float) -> dict:
    """Run the requests through the scheduler in virtual time; TTFT and ITL of those arriving after ``warmup_s``."""
    now = [0.0]
    sched = Scheduler(SchedulerConfig(max_model_len=8192, **config), BlockPool(KV_TOKENS // 16, 16),
                      clock=lambda: now[0])
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    arrival: dict[str, float] = {}
    predicted: dict[str, float] = {}
    i = steps = 0
    busy = 0.0
    spent = [0.0] * len(TERMS)  # each term's count summed over the steps
    while i < len(requests) or sched.has_unfinished():
        while i < len(requests) and requests[i][0] <= now[0]:
            t, n_in, n_out = requests[i]
            rid = f"r{i}"
            arrival[rid] = t
            # what admission would know of it (Scheduler.predict_ttft): the replay takes arrivals in at the end of
            # the step they arrived in, so the part of that step they waited for is known by then
            predicted[rid] = now[0] - t + sched.predict_ttft(n_in)
            # distinct token ids per request: no prefix shared between requests, as vs_vllm.py's serial numbers
            sched.add(Sequence(request_id=rid, prompt_token_ids=[(i * 7919 + k) % 40000 + 100 for k in range(n_in)],
                               sampling=SamplingParams(max_tokens=n_out, temperature=0), arrival_time=t))
            i += 1
        out = sched.schedule() if sched.has_unfinished() else None
        if out is None or not out.chunks:
            now[0] = requests[i][0] if i < len(requests) else now[0] + 1e-3
            continue
        dt = cost(out.shape)
        sched.cost.observe(out.shape, dt)  # as the engine feeds it every timed step
        now[0] += dt
        busy += dt
        steps += 1
        for k, x in enumerate(terms(out.shape)):
            spent[k] += x
        sched.advance(out)
        for c in out.chunks:
            if not c.samples:
                continue
            seq, rid = c.seq, c.seq.request_id
            seq.output_token_ids.append(1)
            if rid not in first:
                first[rid] = now[0]
            elif arrival[rid] >= warmup_s:
                gaps.append(now[0] - last[rid])
            last[rid] = now[0]
            if len(seq.output_token_ids) >= seq.sampling.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
    ttft = [first[r] - t for r, t in arrival.items() if t >= warmup_s]
    ratio = [predicted[r] / (first[r] - t) for r, t in arrival.items() if t >= warmup_s]
    return {"requests": len(ttft), "steps": steps,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "itl_p99_s": float(np.percentile(gaps, 99)) if gaps else None, "busy_s": busy,
            "predicted_over_actual_ttft": {f"p{q}": float(np.percentile(ratio, q)) for q in (10, 50, 90)}, "span_s": now[0],
            "term_counts": dict(zip(TERMS, spent))}


def fields(pairs: list[str]) -> dict:
    """``key=value`` pairs to SchedulerConfig keywords; values read as JSON (``0``, ``0.1``, ``null``)."""
    out = {}
    for p in pairs:
        key, _, value = p.partition("=")
        if key not in SchedulerConfig.__dataclass_fields__:
            raise SystemExit(f"not a SchedulerConfig field: {key}")
        out[key] = json.loads(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", nargs="*", default=[], metavar="FIELD=VALUE", help="setting A's SchedulerConfig fields")
    ap.add_argument("--b", nargs="*", default=[], metavar="FIELD=VALUE", help="setting B's SchedulerConfig fields")
    ap.add_argument("--rates", default="3.4,6,9")
    ap.add_argument("--duration", type=float, default=300.0, help="virtual seconds of arrivals per run")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--length-scale", type=float, default=0.125)
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--fit-steps", type=int, default=600, help="engine steps timed for the cost model")
    ap.add_argument("--costs", type=Path, default=None, help="reuse the cost model of an earlier run's JSON")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    settings = {"A": fields(args.a), "B": fields(args.b)}

    if args.costs:
        coef, err = json.loads(args.costs.read_text())["cost_model"], None
        print(f"cost model from {args.costs}")
    else:
        print(f"timing {args.fit_steps} engine steps", flush=True)
        coef, err = fit(measure_steps(args.fit_steps, seed=0))
    print("step seconds = " + " + ".join(f"{v:.3g} x {k}" for k, v in coef.items())
          + (f"  (median error {err:.1%})" if err is not None else ""))
    c = [coef[k] for k in TERMS]

    def cost(shape: StepShape) -> float:
        return sum(a * b for a, b in zip(c, terms(shape)))

    rows = []
    print(f"\n{'rate':>5} | {'setting':7} | {'TTFT P50':>9} | {'TTFT P99':>9} | {'ITL P99':>8} | steps (median of "
          f"{args.seeds} seeds, {args.duration:g} s each)")
    for rate in (float(r) for r in args.rates.split(",")):
        for name, cfg in settings.items():
            runs = [replay(trace_requests(rate, args.duration, s, args.length_scale), cfg, cost, 5.0)
                    for s in range(args.seeds)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "steps")}
            rows.append({"rate": rate, "setting": name, **med, "runs": runs})
            print(f"{rate:>5g} | {name:7} | {med['ttft_p50_s'] * 1e3:>6.0f} ms | {med['ttft_p99_s'] * 1e3:>6.0f} ms | "
                  f"{med['itl_p99_s'] * 1e3:>5.0f} ms | {med['steps']:.0f}", flush=True)

    print(f"\nwhere setting A's step time goes (share of busy time; busy / elapsed), {args.seeds} seeds pooled:")
    print(f"{'rate':>5} | " + " | ".join(f"{t:>13}" for t in TERMS) + " | busy")
    for r in (r for r in rows if r["setting"] == "A"):
        busy = sum(x["busy_s"] for x in r["runs"])
        share = [sum(x["term_counts"][t] for x in r["runs"]) * coef[t] / busy for t in TERMS]
        r["time_share"] = dict(zip(TERMS, share))
        print(f"{r['rate']:>5g} | " + " | ".join(f"{v:>13.1%}" for v in share)
              + f" | {busy / sum(x['span_s'] for x in r['runs']):.0%}")

    print("\nsetting A: TTFT predicted at arrival (Scheduler.predict_ttft) / the replay's, P10 / P50 / P90 over "
          "requests, median over seeds:")
    for r in (r for r in rows if r["setting"] == "A"):
        q = {k: statistics.median(x["predicted_over_actual_ttft"][k] for x in r["runs"]) for k in ("p10", "p50", "p90")}
        r["predicted_over_actual_ttft"] = q
        print(f"{r['rate']:>5g} req/s: {q['p10']:.2f} / {q['p50']:.2f} / {q['p90']:.2f}")

    capacity = {}
    for name, cfg in settings.items():
        def passes(rate: float, cfg=cfg) -> bool:
            p99 = statistics.median(replay(trace_requests(rate, args.duration / 2, s, args.length_scale), cfg, cost,
                                           5.0)["ttft_p99_s"] for s in range(args.seeds))
            return p99 <= args.slo_ttft
        lo, hi = 1.0, 64.0
        while hi / lo > 1.02:
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if passes(mid) else (lo, mid)
        capacity[name] = lo
    print(f"\ncapacity (TTFT P99 <= {args.slo_ttft:g} s): A {capacity['A']:.1f} req/s, B {capacity['B']:.1f} req/s, "
          f"B / A {capacity['B'] / capacity['A']:.3f}")
    for r in [r for r in rows if r["setting"] == "B"]:
        a = next(x for x in rows if x["setting"] == "A" and x["rate"] == r["rate"])
        print(f"{r['rate']:>5g} req/s: TTFT P99 B / A {r['ttft_p99_s'] / a['ttft_p99_s']:.3f}, "
              f"ITL P99 B / A {r['itl_p99_s'] / a['itl_p99_s']:.3f}")
    out = {"benchmark": "schedule_replay", "date": datetime.date.today().isoformat(),
           "command": "benchmarks/schedule_replay.py " + " ".join(sys.argv[1:]), "settings": settings,
           "cost_model": coef, "cost_model_median_error": err, "rates": rows, "capacity_req_s": capacity,
           "load_average": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
