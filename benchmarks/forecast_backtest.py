"""Backtest of the arrival forecasters on the Azure LLM inference traces (issue 12, E1/M4).

Each trace (conv, code) is bucketed into 10 s and 60 s periods. A season is looked for on the first half only (what a
forecaster could know at the first origin); the second half is scored by rolling origin at every period, horizons 1, 3
and 6 periods ahead. Holt-Winters and the LSTM are refitted on the history they have every ``--refit-minutes`` of
trace time and forecast from the latest history at every origin. Seeds are fixed: two runs print the same table.

Then the capacity planner turns the winning forecaster's forecasts of the conv trace into the cap, token budget and
replicas for this engine (the measured throughput of ``benchmarks/results/engine_throughput.json``) at the trace's
request mix, and reports the range of settings it would have chosen.

Last (``--no-simulate`` skips it), a *model* of the engine (``tailguard.plan.simulate``: step times from the same
throughput curve) replays the start of the conv trace, slowed down and with lengths scaled to this engine, under static
caps and under the forecast-driven cap (``ForecastCapController``, Holt-Winters at 10 s), at three loads. A model, not
a measurement: it says whether the real replay is worth running and what to expect of it.

    python benchmarks/forecast_backtest.py            # writes benchmarks/results/forecast_backtest.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the machine is shared: at most one core for the LSTM

import numpy as np  # noqa: E402

from tailguard.bench.workloads import BUILTIN_TRACES  # noqa: E402
from tailguard.plan.backtest import rolling_origin, versus_last_value  # noqa: E402
from tailguard.plan.capacity import ServiceProfile, plan_ahead, widest_useful_cap  # noqa: E402
from tailguard.plan.controller import ForecastCapController  # noqa: E402
from tailguard.plan.forecast import arrival_counts, default_forecasters, detect_period, read_arrival_times  # noqa: E402
from tailguard.plan.simulate import compare_caps, trace_requests  # noqa: E402

ROOT = Path(__file__).resolve().parent
HORIZONS = (1, 3, 6)


def token_columns(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = [(float(r["ContextTokens"]), float(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    a = np.array(rows)
    return a[:, 0], a[:, 1]


def mean_tokens(path: Path) -> tuple[float, float]:
    ins, outs = token_columns(path)
    return float(ins.mean()), float(outs.mean())


SIM_STATIC_CAPS = (2, 4, 8, 16, 32, 64)


def simulate_caps(engine_json: Path, speedups: list[float], length_scale: float, sim_seconds: float) -> list[dict]:
    """Static caps vs the forecast-driven cap (bounds 16 and 64) in the engine model, at each trace speed."""
    times = read_arrival_times(BUILTIN_TRACES["conv"])
    ins, outs = token_columns(BUILTIN_TRACES["conv"])
    engine = ServiceProfile.from_engine_throughput(engine_json, 1.0, 1.0)
    out = []
    for speed in speedups:
        reqs = trace_requests(times, ins, outs, speedup=speed, length_scale=length_scale, limit_s=sim_seconds)
        prof = ServiceProfile(float(np.mean([r.input_tokens for r in reqs])),
                              float(np.mean([r.output_tokens for r in reqs])),
                              engine.prefill_tokens_per_s, dict(engine.decode_tokens_per_s))
        rows = compare_caps(reqs, prof, SIM_STATIC_CAPS, lambda p=prof: ForecastCapController(
            p, period_s=10.0, horizon=6, replicas=1, max_seqs=16, start=0.0))
        rows[-1]["policy"] = "forecast-driven cap 2-16"
        wide = compare_caps(reqs, prof, (64,), lambda p=prof: ForecastCapController(
            p, period_s=10.0, horizon=6, replicas=1, max_seqs=64, start=0.0))[-1]
        wide["policy"] = "forecast-driven cap 2-64"
        rows.append(wide)
        static = [r for r in rows if r["policy"].startswith("static")]
        best = min(static, key=lambda r: r["e2e_p99_s"])
        out.append({"trace_speedup": speed, "length_scale": length_scale, "requests": len(reqs),
                    "offered_requests_per_s": len(reqs) / sim_seconds, "mean_input_tokens": prof.mean_input_tokens,
                    "mean_output_tokens": prof.mean_output_tokens, "policies": rows,
                    "best_static": best["policy"],
                    "forecast_vs_best_static_p99": {r["policy"]: r["e2e_p99_s"] / best["e2e_p99_s"]
                                                    for r in rows if r["policy"].startswith("forecast")}})
    return out


def backtest_one(trace: str, period_s: float, refit_minutes: float, seed: int) -> dict:
    counts = arrival_counts(read_arrival_times(BUILTIN_TRACES[trace]), period_s)
    first = counts.size // 2
    season = detect_period(counts[:first])
    refit_every = max(1, round(refit_minutes * 60 / period_s))
    t0 = time.perf_counter()
    scores = rolling_origin(counts, default_forecasters(season, max(HORIZONS), seed=seed), HORIZONS,
                            first_origin=first, refit_every=refit_every)
    return {
        "trace": trace, "period_s": period_s, "periods": int(counts.size), "first_origin": first,
        "origins": int(counts.size - first - max(HORIZONS) + 1), "refit_every_periods": refit_every,
        "season_periods": season, "mean_count": float(counts.mean()), "cv": float(counts.std() / counts.mean()),
        "zero_periods": int((counts == 0).sum()), "seconds": time.perf_counter() - t0,
        "forecasters": [s.as_dict() for s in scores], "verdict": versus_last_value(scores, seed=seed),
        "_scores": scores, "_counts": counts,
    }


def plan_from(run: dict, profile: ServiceProfile, max_seqs: int) -> dict:
    """The plans the winner's forecasts would have set at each origin (peak of the next 6 periods, one replica
    sized by the planner), summarised: the spread of the cap is what forecast-driven batching changes."""
    win = next(s for s in run["_scores"] if s.name == run["verdict"]["winner"])
    plans = [plan_ahead(f, run["period_s"], profile, max_seqs=max_seqs) for f in win.forecasts]
    caps = [p.max_num_seqs for p in plans]
    return {"forecaster": win.name, "max_seqs_bound": max_seqs, "origins": len(plans),
            "cap": {"min": min(caps), "median": float(np.median(caps)), "max": max(caps)},
            "token_budget": {"min": min(p.max_num_batched_tokens for p in plans),
                             "max": max(p.max_num_batched_tokens for p in plans)},
            "replicas": {"min": min(p.replicas for p in plans), "max": max(p.replicas for p in plans)},
            "saturated_origins": sum(p.saturated for p in plans)}


def table(runs: list[dict]) -> str:
    head = " ".join(f"{'MAE h' + str(h):>8} {'MAPE%':>6} {'WAPE%':>6}" for h in HORIZONS)
    lines = [f"{'trace':5} {'period':>6} {'forecaster':20} {head} {'vs last [95% CI]':>18} {'fit s':>6}"]
    for r in runs:
        base = r["verdict"]["last_value_mean_mae"]
        for f in r["forecasters"]:
            cells = " ".join(f"{h['mae']:8.1f} {'-' if h['mape_pct'] is None else round(h['mape_pct'], 1)!s:>6} "
                             f"{h['wape_pct']:6.1f}" for h in f["horizons"])
            mark = "*" if f["forecaster"] == r["verdict"]["winner"] else " "
            ci = r["verdict"]["mae_ratio_to_last_value"][f["forecaster"]]["overall_ci95"]
            vs = f"{f['mean_mae'] / base:5.2f}" + (f" [{ci[0]:.2f},{ci[1]:.2f}]" if ci else " " * 12)
            lines.append(f"{r['trace']:5} {r['period_s']:5.0f}s {mark}{f['forecaster']:19} {cells} "
                         f"{vs:>18} {f['fit_seconds_max']:6.2f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--periods", default="10,60", help="bucket sizes in seconds")
    ap.add_argument("--traces", default="conv,code")
    ap.add_argument("--refit-minutes", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "forecast_backtest.json"))
    ap.add_argument("--no-simulate", dest="simulate", action="store_false",
                    help="skip the engine-model comparison of static and forecast-driven caps")
    ap.add_argument("--sim-speedups", default="0.2,0.3,0.4", help="conv trace speeds for the model (1 = real time)")
    ap.add_argument("--sim-length-scale", type=float, default=0.25, help="trace token lengths x this for the model")
    ap.add_argument("--sim-seconds", type=float, default=1800.0, help="model time replayed at each speed")
    args = ap.parse_args()
    t0 = time.perf_counter()
    runs = [backtest_one(tr, float(p), args.refit_minutes, args.seed)
            for tr in args.traces.split(",") for p in args.periods.split(",")]
    print(table(runs))
    print("(* = lowest mean MAE over horizons; 'vs last' = mean MAE / last-value's mean MAE, with a 95% moving-block "
          "bootstrap interval over origins)")
    engine_json = ROOT / "results" / "engine_throughput.json"
    planning = []
    if engine_json.is_file():
        for r in runs:
            if r["trace"] != "conv":
                continue
            mi, mo = mean_tokens(BUILTIN_TRACES["conv"])
            prof = ServiceProfile.from_engine_throughput(engine_json, mi, mo)
            for bound in (16, widest_useful_cap(prof)):
                planning.append({"trace": "conv", "period_s": r["period_s"], "mean_input_tokens": mi,
                                 "mean_output_tokens": mo, **plan_from(r, prof, bound)})
        for p in planning:
            print(f"plan conv {p['period_s']:.0f}s ({p['forecaster']}, cap bound {p['max_seqs_bound']}): cap "
                  f"{p['cap']['min']}-{p['cap']['max']} (median {p['cap']['median']:g}), token budget "
                  f"{p['token_budget']['min']}-{p['token_budget']['max']}, replicas {p['replicas']['min']}-"
                  f"{p['replicas']['max']}")
    simulation = []
    if args.simulate and engine_json.is_file():
        simulation = simulate_caps(engine_json, [float(x) for x in args.sim_speedups.split(",")],
                                   args.sim_length_scale, args.sim_seconds)
        print("\nengine MODEL (not a measurement): conv trace, lengths x"
              f"{args.sim_length_scale:g}, {args.sim_seconds:.0f} s replayed; E2E P50 / P99 and TTFT P99 in seconds")
        for sim in simulation:
            print(f"  speed x{sim['trace_speedup']:g} ({sim['offered_requests_per_s']:.2f} req/s, "
                  f"{sim['requests']} requests), best static: {sim['best_static']}")
            for r in sim["policies"]:
                print(f"    {r['policy']:26} {r['e2e_p50_s']:8.2f} {r['e2e_p99_s']:8.2f} {r['ttft_p99_s']:8.2f}"
                      f"  cap {r['cap_range'][0]}-{r['cap_range'][1]}, {r['cap_changes']} changes")
    out = {
        "benchmark": "forecast_backtest",
        "command": "python benchmarks/forecast_backtest.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "duration_s": time.perf_counter() - t0,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "threads": 1},
        "config": {"horizons": list(HORIZONS), "refit_minutes": args.refit_minutes, "seed": args.seed,
                   "scored": "second half of each series, rolling origin at every period"},
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
        "planning": planning,
        "cap_model": {"note": "a step-level MODEL of the engine from its measured throughput curve "
                              "(tailguard.plan.simulate), not a measurement", "runs": simulation},
        "attribution": "Azure LLM inference trace 2023, CC-BY 4.0, Patel et al., Splitwise (ISCA 2024)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
