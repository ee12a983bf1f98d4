#!/usr/bin/env python3
"""The case study, reproduced in kind: one service's evening peak, before and after tailguard's controls.

    .venv/bin/python examples/case-study/case_study.py                 # ~30 min; writes runs/case-study/ab/report.html
    .venv/bin/python examples/case-study/case_study.py --quick         # ~5 min: one repeat each, no sweep

A service runs two engine replicas. **Before** is what a team deploys first: the two replicas behind a gateway that
only routes (least-loaded), every request in one lane first come first served, no admission, no SLO monitor.
**After** is the same two replicas behind ``tailguard serve --upstream`` with the controls on: API keys bound to
traffic classes (vip, standard, batch), vip's 20% reserve and the 5% burst pool, the upstream queue gate (requests
wait at the gateway, in lane order, not in the replicas' first-come queues), priorities sent to the replicas, and
the third replica started by the process provider as soon as requests wait 1 s at the gateway (and stopped, drained,
once the other two carry the load), and the SLO monitor's tiers acting: orange sheds batch, red truncates non-vip
answers.

The load is the busiest stretch of the Azure LLM inference trace (conversation, 2023, shipped with tailguard),
time-scaled to put *before* at its knee, from three classes: vip 10%, standard 60%, batch 30%, each with its own
API key and SLO profile. ``tailguard bench ab`` sends the same schedule to both arms in alternating repeats and
writes one report: per arm and class the percentiles with confidence intervals, goodput, where the time went, and
cost as replica-seconds.

The replicas are tailguard's scripted engine with a cost model (``engine/fake.py``): a first token after 30 ms plus
10 us per prompt byte, decode gaps of 10 ms plus 0.75 ms per other running sequence, 16 sequences at a time, waiting
requests taken most important first. A real engine on this 2-vCPU machine could not show what a third replica adds
(it would share the same two cores); the scripted engine stands for replicas with compute of their own, so what
changes between the arms is the control, and everything else (the gateway, the provider's processes, the monitor,
the bench) is the real thing.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The replicas' engine (tailguard serve --model fake): see the module docstring.
REPLICA = {
    "fake": {"ttft": 0.03, "prefill_per_token": 0.00001, "itl": 0.01, "itl_per_running": 0.00075,
             "max_num_seqs": 16, "max_model_len": 65536, "priority_scheduling": True},
    "trust_lane_header": True,  # takes the gateway's priority (the lane's), as a vLLM with priority scheduling does
}


def _upstreams(send_priority: bool) -> list[dict[str, Any]]:
    return [{"url": "{replica1}", "max_concurrent": 16, "send_priority": send_priority},
            {"url": "{replica2}", "max_concurrent": 16, "send_priority": send_priority}]


# Before: routing only. One lane (no keys: everything is "standard"), no queue gate, no SLO monitor.
BEFORE = {
    "upstreams": _upstreams(False),
    "capacity": {"upstream_queue_limit": None, "reserved_share": 0.0, "burst_share": 0.0},
    "lanes": {"standard": {"priority": 1, "max_queue": 100000, "max_queue_wait_s": 3600}},
    "default_lane": "standard",
}


def after_config(work: Path) -> dict[str, Any]:
    replica_cmd = (f"{sys.executable} -m tailguard.cli serve --model fake --config {work / 'replica.yaml'} "
                   f"--port {{port}} --store {work / '{name}.sqlite3'} --no-slo --no-access-log --log-level warning")
    return {
        "upstreams": _upstreams(True),
        "capacity": {"reserved_share": 0.2, "burst_share": 0.05, "upstream_queue_limit": 1},
        "lanes": {
            "vip": {"priority": 0, "reserved": True, "sheddable": False, "max_queue_wait_s": 10},
            "standard": {"priority": 1, "max_queue_wait_s": 60},
            "batch": {"priority": 2, "burst": False, "max_queue": 4096, "max_queue_wait_s": 300},
        },
        "default_lane": "standard",
        "slo": {
            # The trace's stretch is minutes long: the windows and the dwell are shortened with it.
            "eval_interval_s": 1.0, "slot_s": 5.0, "peak_window_s": 60.0, "offpeak_window_s": 60.0,
            "peak": {"mode": "always"},
            "tiers": {"min_samples": 30, "min_dwell_s": 90.0, "raise_after": 2, "clear_after": 5},
            # The interactive lanes' tiers are the service's distress: they shed batch (orange) and truncate
            # answers (red). The third replica follows the gateway's own backlog (the provider's autoscale below).
            "scopes": [{"name": "interactive", "where": {"lanes": ["vip", "standard"]}}],
            "actions": {
                "scale_out": {"replicas_pct": 10, "provider": {
                    "kind": "process", "command": replica_cmd, "max_replicas": 1, "max_concurrent": 16,
                    "send_priority": True, "start_timeout_s": 60, "drain_timeout_s": 60,
                    "log_dir": str(work / "logs"),
                    # Its defaults: a request of any lane waiting 1 s at the gateway (for 1 s) starts it; 20 s
                    # of nothing waiting with the load fitting the other two at 70% stops it, drained.
                    "autoscale": {}}},
                "shed": {"non_core_lanes": ["batch"], "status": 429, "retry_after_s": 30},
                "degrade": {"mode": "truncate", "max_tokens": 128},
            },
        },
    }


PROFILES = {
    "profiles": {
        "vip": {"description": "the first token within 0.5 s, then at least 10 tokens/s",
                "objectives": [{"metric": "ttft", "percentile": 99, "threshold": "500ms"},
                               {"metric": "tpot", "percentile": 99, "threshold": "100ms"},
                               {"metric": "error_rate", "threshold": "0.5%", "comparison": "<"}]},
        "standard": {"description": "the first token within 2 s, then at least 10 tokens/s",
                     "objectives": [{"metric": "ttft", "percentile": 99, "threshold": "2s"},
                                    {"metric": "tpot", "percentile": 99, "threshold": "100ms"},
                                    {"metric": "error_rate", "threshold": "1%", "comparison": "<"}]},
        "batch": {"description": "done within 5 minutes",
                  "objectives": [{"metric": "e2e", "percentile": 99, "threshold": "300s"}]},
    }
}


def prepare(work: Path) -> dict[str, str]:
    """Write the configs, the key file and the bench's classes into ``work``; returns the classes' keys."""
    from tailguard.policy.tenants import KeyFile

    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    (work / "replica.yaml").write_text(yaml.safe_dump({**REPLICA, "slo": {"enabled": False}}, sort_keys=False))
    (work / "before.yaml").write_text(yaml.safe_dump(BEFORE, sort_keys=False))
    (work / "after.yaml").write_text(yaml.safe_dump(after_config(work), sort_keys=False))
    peak = after_config(work)  # the same, with the third replica started with the gateway: scheduled for the peak
    peak["slo"]["actions"]["scale_out"]["provider"]["min_replicas"] = 1
    peak["slo"]["actions"]["scale_out"]["provider"]["autoscale"] = None
    (work / "after-peak.yaml").write_text(yaml.safe_dump(peak, sort_keys=False))
    (work / "profiles.yaml").write_text(yaml.safe_dump(PROFILES, sort_keys=False))
    standard = {"profiles": {"standard": PROFILES["profiles"]["standard"]}}  # the SLO a sweep's scale must pass
    (work / "standard-profile.yaml").write_text(yaml.safe_dump(standard, sort_keys=False))
    kf = KeyFile()
    keys = {lane: kf.add_key(f"{lane}-tenant", lane) for lane in ("vip", "standard", "batch")}
    kf.save(work / "keys.yaml")
    classes = {"classes": [
        {"name": "vip", "share": 0.1, "key": keys["vip"], "profile": ["vip"]},
        {"name": "standard", "share": 0.6, "key": keys["standard"], "profile": ["standard"]},
        {"name": "batch", "share": 0.3, "key": keys["batch"], "profile": ["batch"]},
    ]}
    (work / "classes.yaml").write_text(yaml.safe_dump(classes, sort_keys=False))
    (work / "classes.yaml").chmod(0o600)  # it holds the keys
    return keys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "case-study")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--window", default="1560:150",
                   help="the trace's stretch, START:SECONDS in trace time (default: 150 s of its busiest stretch)")
    p.add_argument("--time-scale", type=float, default=1.1,
                   help="the trace's arrivals this many times faster (1.0 puts before at its knee: its TTFT P99 at "
                        "the 2 s SLO)")
    p.add_argument("--sweep-scales", default="0.8,1.0,1.25,1.6",
                   help="time scales for the highest rate each arm serves within the standard class's SLO ('' : none)")
    p.add_argument("--arms", default="before,after",
                   help="which arms, the first the baseline: before, after, after-peak (the third replica up for the "
                        "whole peak, as a team that knows its evening peak schedules it)")
    p.add_argument("--quick", action="store_true", help="one repeat, no sweep (~5 min)")
    p.add_argument("--prepare-only", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.sweep_scales = 1, ""
    work = args.out / "work"
    prepare(work)
    if args.prepare_only:
        print(f"wrote {work}")
        return 0
    arm = f"{sys.executable} {HERE / 'arm.py'}"
    cmd = [sys.executable, "-m", "tailguard.cli", "bench", "ab"]
    for name in args.arms.split(","):
        cmd += ["--arm", f"{name}=cmd:{arm} {name} --port {{port}} --work {work}"]
    cmd += ["--health-path", "/ready", "--health-timeout", "180", "--stop-grace", "90",
           "--trace", "conv", "--window", args.window, "--time-scale", str(args.time_scale),
           "--classes", str(work / "classes.yaml"), "--profiles-file", str(work / "profiles.yaml"),
           "--repeats", str(args.repeats), "--order", "abba", "--output-dir", str(args.out / "ab"),
           "--model", "fake", "--label", "case study"]
    if args.sweep_scales:
        cmd += ["--sweep-scales", args.sweep_scales, "--sweep-profile", str(work / "standard-profile.yaml")]
    print("$ " + " ".join(c if " " not in c else repr(c) for c in cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"case study: {time.time() - t0:.0f} s, exit {rc}; report: {args.out / 'ab' / 'report.html'}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
