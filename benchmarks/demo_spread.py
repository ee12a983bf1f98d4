#!/usr/bin/env python
"""Run-to-run spread of ``tailguard demo``: the demo N times, each in a fresh process, and how far its burst varies.

Each run is ``tailguard demo`` in its own Python process (first-use costs included, as a user meets them), with its
own output directory. Per run: the burst's wall time, TTFT P50/P99 and E2E P99 (the server's figures, from the
demo's results.json), the output tokens (the answers are greedy: a run that produced other tokens did other work),
and the CPU that other processes on the host used, during the burst (the demo measures it from /proc/stat) and over
the whole run (measured here: all CPUs' busy time minus the demo process's own). Then the max/min ratio of each
figure over the runs: the demo should stay within 1.3x on a quiet machine, and the other processes' CPU says how
quiet this one was.

``--baseline-module FILE`` runs another demo module (e.g. the demo before a change, saved to a file with
``git show REV:src/tailguard/demo.py``) alternately with the current one, in the same conditions, and reports both.
Before each run the script waits (``--quiet-wait``) for the host to calm down; it cannot make a shared host quiet,
so every run's figures come with the other processes' CPU, and the spread of the runs whose burst had the host
nearly to itself (other processes under 0.25 cores) is given apart.

    .venv/bin/python benchmarks/demo_spread.py                  # 6 runs, no bench part (~2 minutes)
    .venv/bin/python benchmarks/demo_spread.py --runs 8 --baseline-module /tmp/demo_before.py
    .venv/bin/python benchmarks/demo_spread.py --append                 # one more session in the same file

Prints a table and writes benchmarks/results/demo_spread.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
RESULT = ROOT / "results" / "demo_spread.json"
QUIET_CORES = 0.25  # a burst during which other processes used less than this counts as a quiet one
# Runs ``tailguard demo`` (or, with a module path, that file's run_demo) with the CLI's own parser.
LAUNCH = """
import importlib.util, sys
from tailguard.cli import build_parser
path = sys.argv[1]
argv = sys.argv[2:]
if not path:
    from tailguard.cli import main
    sys.exit(main(argv))
spec = importlib.util.spec_from_file_location("demo_under_test", path)
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod  # dataclasses look their module up there
spec.loader.exec_module(mod)
sys.exit(mod.run_demo(build_parser().parse_args(argv)))
"""


def read_stat() -> dict[str, int]:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]] + [0] * 10
            return {"busy": v[0] + v[1] + v[2] + v[5] + v[6], "steal": v[7]}
    raise RuntimeError("no cpu line in /proc/stat")


def children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def wait_quiet(max_wait_s: float, cores: float = 0.3) -> float:
    """Wait (at most ``max_wait_s``) until the host's CPUs are busy less than ``cores`` over a second."""
    hz, began = os.sysconf("SC_CLK_TCK"), time.monotonic()
    while time.monotonic() - began < max_wait_s:
        a = read_stat()
        time.sleep(1.0)
        if (read_stat()["busy"] - a["busy"]) / hz < cores:
            break
    return time.monotonic() - began


def one_run(label: str, module: str, out_dir: Path, demo_args: list[str]) -> dict[str, Any]:
    hz = os.sysconf("SC_CLK_TCK")
    stat0, own0, t0 = read_stat(), children_cpu(), time.monotonic()
    load0 = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", LAUNCH, module, "demo", "--output-dir", str(out_dir), *demo_args],
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    stat1, own1 = read_stat(), children_cpu()
    if proc.returncode != 0:
        raise RuntimeError(f"the demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    busy = (stat1["busy"] - stat0["busy"]) / hz
    own = own1 - own0
    res = json.loads((out_dir / "results.json").read_text())
    s = res["summary"]
    p = s["percentiles"]
    burst_load = s.get("host_load") or {}
    return {
        "label": label,
        "burst_wall_s": s["wall_s"],
        "ttft_p50_s": p["TTFT"]["p50"], "ttft_p99_s": p["TTFT"]["p99"], "e2e_p99_s": p["E2E"]["p99"],
        "output_tokens": s["output_tokens"],
        "engine_steps": s.get("engine_steps"),
        # The burst's own CPU seconds: the same work every run, so a longer burst waited for the CPU.
        "burst_own_cpu_s": (burst_load["own_cores"] * burst_load["wall_s"]) if burst_load else None,
        "burst_others_cores": burst_load.get("others_cores"),
        "burst_steal_cores": burst_load.get("steal_cores"),
        "quiet_wait_s": (s.get("quiet_wait") or {}).get("waited_s"),
        "run_wall_s": wall,
        "run_others_cores": max(0.0, busy - own) / wall,
        "run_steal_cores": (stat1["steal"] - stat0["steal"]) / hz / wall,
        "loadavg_1m_before": load0,
    }


def spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("burst_wall_s", "ttft_p50_s", "ttft_p99_s", "e2e_p99_s"):
        vals = [r[key] for r in rows]
        out[key] = {"min": min(vals), "max": max(vals), "max_over_min": max(vals) / min(vals)}
    others = [r["burst_others_cores"] for r in rows if r["burst_others_cores"] is not None]
    out["burst_others_cores"] = {"min": min(others), "max": max(others)} if others else None
    out["run_others_cores"] = {"min": min(r["run_others_cores"] for r in rows),
                               "max": max(r["run_others_cores"] for r in rows)}
    own = [r["burst_own_cpu_s"] for r in rows if r["burst_own_cpu_s"] is not None]
    out["burst_own_cpu_s"] = {"min": min(own), "max": max(own), "max_over_min": max(own) / min(own)} if own else None
    if len(others) == len(rows) >= 3:
        # How much of the spread the other processes' CPU explains (Pearson r of burst wall time on it).
        out["wall_vs_others_r"] = float(np.corrcoef([r["burst_wall_s"] for r in rows], others)[0, 1])
    # The runs whose burst had the host nearly to itself: the spread a quiet machine would show.
    quiet = [r["burst_wall_s"] for r in rows
             if r["burst_others_cores"] is not None and r["burst_others_cores"] < QUIET_CORES]
    out["quiet_runs"] = ({"runs": len(quiet), "others_below_cores": QUIET_CORES, "burst_wall_min_s": min(quiet),
                          "burst_wall_max_s": max(quiet), "max_over_min": max(quiet) / min(quiet)}
                         if len(quiet) >= 2 else None)
    out["same_output_tokens"] = len({r["output_tokens"] for r in rows}) == 1
    out["within_30_percent"] = out["burst_wall_s"]["max_over_min"] <= 1.3
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'run':>3} {'version':9} {'burst s':>8} {'TTFT P50':>9} {'TTFT P99':>9} {'E2E P99':>8} {'tokens':>6} "
            f"{'own CPU s':>9} {'others(burst)':>13} {'others(run)':>11} {'steal':>6} {'quiet wait':>10}")
    print(head)
    print("-" * len(head))
    for i, r in enumerate(rows):
        others = "-" if r["burst_others_cores"] is None else f"{r['burst_others_cores']:.2f} cores"
        wait = "-" if r["quiet_wait_s"] is None else f"{r['quiet_wait_s']:.1f} s"
        own = "-" if r["burst_own_cpu_s"] is None else f"{r['burst_own_cpu_s']:.2f}"
        print(f"{i + 1:>3} {r['label']:9} {r['burst_wall_s']:8.2f} {r['ttft_p50_s'] * 1000:7.0f}ms "
              f"{r['ttft_p99_s'] * 1000:7.0f}ms {r['e2e_p99_s'] * 1000:6.0f}ms {r['output_tokens']:6d} {own:>9} "
              f"{others:>13} {r['run_others_cores']:7.2f} cores {r['run_steal_cores']:6.2f} {wait:>10}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="demo runs (of each version)")
    ap.add_argument("--requests", type=int, default=16, help="requests of the burst")
    ap.add_argument("--bench-requests", type=int, default=0,
                    help="requests of each run's bench part (0: none; it runs after the burst and does not change it)")
    ap.add_argument("--baseline-module", default="", help="another demo module file, run alternately with this one")
    ap.add_argument("--baseline-label", default="",
                    help="what the baseline module is, for the results (e.g. 'demo.py at commit abc1234')")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each run, wait up to this many seconds for the host to be quiet (0: do not wait)")
    ap.add_argument("--output", default=str(RESULT))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--append", action="store_true", help="add this session to the sessions already in --output")
    args = ap.parse_args()
    demo_args = ["--requests", str(args.requests), "--bench-requests", str(args.bench_requests)]
    versions = [("current", "")] + ([("baseline", args.baseline_module)] if args.baseline_module else [])
    rows: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with tempfile.TemporaryDirectory(prefix="demo-spread-") as tmp:
        for i in range(args.runs):
            # Alternate the versions, each round starting with the other, so that drifting host load hits both.
            for label, module in (versions if i % 2 == 0 else versions[::-1]):
                waited = wait_quiet(args.quiet_wait) if args.quiet_wait > 0 else 0.0
                row = one_run(label, module, Path(tmp) / f"{label}-{i}", demo_args)
                row["pre_run_wait_s"] = waited
                rows.append(row)
                print(f"run {len(rows)} ({label}): burst {row['burst_wall_s']:.2f} s, other processes "
                      f"{row['run_others_cores']:.2f} cores", file=sys.stderr)
    print(f"\n{cpu_model()}, {os.cpu_count()} logical CPUs; `tailguard demo` {' '.join(demo_args)}\n")
    print_table(rows)
    summary = {label: spread([r for r in rows if r["label"] == label]) for label, _ in versions}
    for label, s in summary.items():
        print(f"\n{label}: burst wall {s['burst_wall_s']['min']:.2f}-{s['burst_wall_s']['max']:.2f} s "
              f"(max/min {s['burst_wall_s']['max_over_min']:.2f}), TTFT P99 max/min "
              f"{s['ttft_p99_s']['max_over_min']:.2f}, E2E P99 max/min {s['e2e_p99_s']['max_over_min']:.2f}; "
              f"other processes used {s['run_others_cores']['min']:.2f}-{s['run_others_cores']['max']:.2f} cores "
              f"over the runs"
              + (f" ({s['burst_others_cores']['min']:.2f}-{s['burst_others_cores']['max']:.2f} during the bursts)"
                 if s["burst_others_cores"] else "")
              + f"; same output tokens every run: {s['same_output_tokens']}"
              + (f"; burst wall time vs other processes' CPU: r = {s['wall_vs_others_r']:.2f}"
                 if "wall_vs_others_r" in s else ""))
        q = s["quiet_runs"]
        if q:
            print(f"  the {q['runs']} bursts during which other processes used < {QUIET_CORES} cores: "
                  f"{q['burst_wall_min_s']:.2f}-{q['burst_wall_max_s']:.2f} s (max/min {q['max_over_min']:.2f})")
    if not args.no_write:
        session = {"started_at": started, "command": " ".join(["tailguard demo", *demo_args]),
                   "versions": {"current": "src/tailguard/demo.py of this working tree",
                                **({"baseline": args.baseline_label or args.baseline_module}
                                   if args.baseline_module else {})},
                   "runs": rows, "spread": summary}
        out = Path(args.output)
        sessions = []
        if args.append and out.exists():
            old = json.loads(out.read_text())
            sessions = old.get("sessions") or [{k: v for k, v in old.items() if k in ("command", "versions", "runs",
                                                                                     "spread")}]
        doc = {"benchmark": "demo_spread",
               "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(), "python": platform.python_version()},
               "note": "others = CPU used by every other process on the host (all CPUs' busy time from /proc/stat "
                       "minus the demo process's own); the demo's burst figures include their competition. Each "
                       "session is one invocation; compare runs within a session.",
               "sessions": [*sessions, session]}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"\nwrote {out} ({len(doc['sessions'])} session{'s' * (len(doc['sessions']) != 1)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
