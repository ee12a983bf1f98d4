"""Backtest of the arrival forecasters on the Azure LLM inference traces (issue 12, E1/M4).

Each trace (conv, code) is bucketed into 10 s and 60 s periods. A season is looked for on the first half only (what a
forecaster could know at the first origin); the second half is scored by rolling origin at every period, horizons 1, 3
and 6 periods ahead. Holt-Winters and the LSTM are refitted on the history they have every ``--refit-minutes`` of
trace time and forecast from the latest history at every origin. Seeds are fixed: two runs print the same table.

Then the capacity planner turns the winning forecaster's forecasts of the conv trace into the cap, token budget and
replicas for this engine (the measured throughput of ``benchmarks/results/engine_throughput.json``) at the trace's
request mix, and reports the range of settings it would have chosen.

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
from tailguard.plan.forecast import arrival_counts, default_forecasters, detect_period, read_arrival_times  # noqa: E402

ROOT = Path(__file__).resolve().parent
HORIZONS = (1, 3, 6)


def mean_tokens(path: Path) -> tuple[float, float]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = [(float(r["ContextTokens"]), float(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    a = np.array(rows)
    return float(a[:, 0].mean()), float(a[:, 1].mean())


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
    lines = [f"{'trace':5} {'period':>6} {'forecaster':20} " + " ".join(
        f"{'MAE h' + str(h):>8} {'MAPE%':>6} {'WAPE%':>6}" for h in HORIZONS) + f" {'vs last [95% CI]':>18} {'fit s':>6}"]
    for r in runs:
        base = r["verdict"]["last_value_mean_mae"]
        for f in r["forecasters"]:
            cells = " ".join(f"{h['mae']:8.1f} {h['mape_pct'] if h['mape_pct'] is None else round(h['mape_pct'], 1)!s:>6} "
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
        "attribution": "Azure LLM inference trace 2023, CC-BY 4.0, Patel et al., Splitwise (ISCA 2024)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
