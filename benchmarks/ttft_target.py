"""What a lane's TTFT target does under overload: the embedded engine with and without ``ttft_target_s``.

    .venv/bin/python benchmarks/ttft_target.py                     # ~9 min; benchmarks/results/ttft_target.json
    .venv/bin/python benchmarks/ttft_target.py --rates 20 --duration 20 --rounds 1   # a quick look

The same load as benchmarks/vs_vllm.py (the Azure conv trace's lengths x 1/8, Poisson arrivals, the same prompts) is
sent by ``tailguard bench`` to ``tailguard serve --model smollm2`` with one lane, twice: without a target, and with
``ttft_target_s`` (``--target``, 1 s by default), where a request whose predicted time to first token misses the
target is refused at once with 429. Rounds alternate the order (off, on / on, off). For each rate and setting: the
share served and refused, the served requests' TTFT P50/P99, the requests answered with a first token inside the
target (per second and as a share of all sent), and how fast a refusal came. Printed as a table, written as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from vs_vllm import (  # noqa: E402
    RESULTS,
    Prompts,
    TreeMemory,
    log,
    make_server,
    post_json,
    rate_args,
    run_bench,
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (the value at rank ceil(q x n)); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def num(s: str) -> float | None:
    return float(s) if s else None


def judge(rows: list[dict], target: float, duration: float) -> dict[str, Any]:
    """The measured requests' figures; per second over the measured part of the run (after rate_args' warm-up)."""
    duration -= min(5.0, duration / 6)
    measured = [r for r in rows if r["warmup"] == "0"]
    served = [r for r in measured if r["ok"] == "1"]
    refused = [r for r in measured if r["status"] == "429"]
    ttft = [num(r["ttft_s"]) or 0.0 for r in served]
    on_time = sum(1 for t in ttft if t <= target)
    refusal_time = [t for t in (num(r["e2e_s"]) or num(r["ttfb_s"]) for r in refused) if t is not None]
    n = len(measured)
    return {
        "sent": n, "served": len(served), "refused": len(refused), "other_failures": n - len(served) - len(refused),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_p99_s": percentile([num(r["e2e_s"]) or 0.0 for r in served], 0.99),
        "on_time": on_time, "on_time_share": on_time / n if n else None, "on_time_per_s": on_time / duration,
        "refusal_p99_s": percentile(refusal_time, 0.99),
    }


def warm_up(url: str, model: str, prompts: Prompts) -> None:
    """Untimed requests (first-use costs out of the measurements); with a target, a long one may be refused."""
    for n_tokens, max_tokens in ((64, 16), (512, 1), (128, 8), (128, 8)):
        try:
            post_json(url + "/v1/chat/completions", {"model": model, "max_tokens": max_tokens, "temperature": 0,
                      "messages": [{"role": "user", "content": prompts.make(n_tokens)}]}, timeout=300)
        except urllib.error.HTTPError as exc:
            if exc.code != 429:
                raise


def config_file(path: Path, target: float | None) -> Path:
    lane = {"priority": 1, **({"ttft_target_s": target} if target else {})}
    path.write_text(json.dumps({"lanes": {"standard": lane}, "default_lane": "standard"}))
    return path  # JSON is YAML


def measure(setting: str, rnd: int, args: argparse.Namespace, workdir: Path, prompts: Prompts) -> dict[str, Any]:
    target = args.target if setting == "on" else None
    wd = workdir / f"{setting}-r{rnd}"
    wd.mkdir(parents=True)
    cfg = config_file(wd / "serve.yaml", target)
    server = make_server("tailguard", SimpleNamespace(tailguard_args=f"--config {cfg} {args.tailguard_args}"), wd)
    out: dict[str, Any] = {"setting": setting, "round": rnd, "ttft_target_s": target, "rates": {}}
    log(f"[{setting} r{rnd}] starting")
    memory: TreeMemory | None = None
    try:
        server.start(300)
        memory = TreeMemory(server.proc.pid)
        memory.start()
        model = server.model()
        warm_up(server.url, model, prompts)
        for rate in args.rates:
            tag = f"rate{rate:g}"
            jsonl = prompts.trace_file(wd / f"{tag}.jsonl", int(rate * args.duration * 1.6) + 50, args.length_scale)
            _, rows = run_bench(server, model, wd / tag, rate_args(jsonl, rate, args.duration, args.seed + rnd, 120),
                                expect_s=args.duration + 5, limit_s=args.duration + 300, memory=memory)
            j = out["rates"][f"{rate:g}"] = judge(rows, args.target, args.duration)
            log(f"[{setting} r{rnd}] {rate:g} req/s: served {j['served']}/{j['sent']}, refused {j['refused']}, "
                f"TTFT P99 {fmt(j['ttft_p99_s'])} s, on time {j['on_time_per_s']:.1f}/s")
    finally:
        if memory is not None:
            memory.stop()
        server.stop()
    return out


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def table(runs: list[dict], args: argparse.Namespace) -> str:
    def med(setting: str, rate: float, key: str) -> float | None:
        vals = [r["rates"][f"{rate:g}"][key] for r in runs if r["setting"] == setting]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    lines = [f"| rate | setting | served | refused | TTFT P50 / P99 (served) | E2E P99 (served) | first token inside "
             f"{args.target:g} s: per s / share of sent | refusal P99 |",
             "| ---: | --- | ---: | ---: | --- | ---: | --- | ---: |"]
    for rate in args.rates:
        for setting in ("off", "on"):
            sent = med(setting, rate, "sent") or 0
            lines.append(
                f"| {rate:g} | {'no target' if setting == 'off' else f'ttft_target_s {args.target:g}'} | "
                f"{(med(setting, rate, 'served') or 0) / max(sent, 1):.0%} | "
                f"{(med(setting, rate, 'refused') or 0) / max(sent, 1):.0%} | "
                f"{fmt(med(setting, rate, 'ttft_p50_s'))} / {fmt(med(setting, rate, 'ttft_p99_s'))} s | "
                f"{fmt(med(setting, rate, 'e2e_p99_s'))} s | {fmt(med(setting, rate, 'on_time_per_s'), 1)} / "
                f"{fmt((med(setting, rate, 'on_time_share') or 0) * 100, 0)}% | "
                f"{fmt((med(setting, rate, 'refusal_p99_s') or 0) * 1000, 0) if setting == 'on' else '-'} ms |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[6.0, 12.0, 18.0],
                   help="req/s of each run (saturation: ~7 req/s on a 2-core EPYC without AMX, ~19 with AMX)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each rate")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--target", type=float, default=1.0, help="the lane's ttft_target_s")
    p.add_argument("--length-scale", type=float, default=0.125, help="trace lengths x this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tailguard-args", default="", help="extra `tailguard serve` flags for both settings")
    p.add_argument("--output", default=str(RESULTS / "ttft_target.json"))
    args = p.parse_args()

    import tempfile

    workdir = Path(tempfile.mkdtemp(prefix="ttft-target-"))
    prompts = Prompts(args.seed)
    runs = []
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        for setting in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
            runs.append(measure(setting, rnd, args, workdir, prompts))
    report = table(runs, args)
    print(report)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    Path(args.output).write_text(json.dumps({
        "command": " ".join(sys.argv), "commit": commit, "machine": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.perf_counter() - t0),
        "args": vars(args), "runs": runs, "table": report}, indent=1))
    print(f"written: {args.output} (work files: {workdir})")


if __name__ == "__main__":
    main()
