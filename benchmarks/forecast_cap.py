"""Forecast-driven batch cap vs static caps on the Azure conv trace replay, same run (issue 12 item 4, E1/M4).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/forecast_cap.py          # benchmarks/results/forecast_cap.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/forecast_cap.py --configs static-4,forecast --duration 30

For each configuration a fresh ``tailguard serve`` (the real model, one thread) is started and ``tailguard bench``
replays the conv trace's first ``--duration`` replay seconds, time-scaled by ``--speedup`` and lengths by
``--length-scale`` (the same window and scaling as benchmarks/techniques.py: the trace's opening minutes ramp from
about 1.3 to 5.8 requests/s, so the load varies within the run). Configurations: ``static-N`` (``--max-num-seqs N``,
the default token budget of 512), ``forecast`` (``--batch-cap forecast``: the cap and the token budget set each
period from a Holt-Winters forecast of arrivals, within 2-16), ``forecast-cap`` (the same, the cap only: the
token budget stays 512) and ``forecast-knee`` (the forecast cap never below the engine's throughput knee, the smallest
cap whose modelled request throughput is within 5% of the best: the hypothesis that a cap below the knee only queues
requests the engine could serve at no loss; measured, it does not hold on this replay: docs/techniques.md).

The forecast plan needs this engine's throughput on this machine now: before the runs, the benchmark measures it
with the same model, weights and thread count (prefill tokens/s of a 512-token prompt; aggregate decode tokens/s
with 1, 4, 8 and 16 streams) and writes it into the forecast server's ``batch_cap`` settings, with the token means
of the replayed requests. During the forecast run, /metrics is polled every second for the cap the server set.

Read from each run's results.json: P50/P95/P99 of E2E and TTFT (bootstrap CIs), throughput, goodput (requests/s
that met every per-request bound of the ``--goodput-profile`` SLO profile) and errors. Configurations run in the
order given, then reversed, for ``--repeats`` rounds; medians are reported. The machine is shared (2 cores, several
agents at once): the load average is recorded with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import cpu_seconds, free_port, wait_ready  # noqa: E402

CAP_GAUGE = "tailguard_batch_cap_max_num_seqs{"
BUDGET_GAUGE = "tailguard_batch_cap_max_num_batched_tokens{"


def calibrate(threads: int, steps: int = 12) -> dict:
    """This engine's prefill and aggregate decode throughput now (the forecast plan's service profile)."""
    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import SamplingParams

    eng = LLMEngine(EngineArgs(model="smollm2", num_threads=threads, max_num_seqs=16, max_num_batched_tokens=512,
                               enable_prefix_caching=False))
    prompt = [(i * 37) % 5000 + 100 for i in range(512)]
    eng.generate([prompt[:64]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    prefill = 512 / (time.perf_counter() - t0)
    decode: dict[int, float] = {}
    for b in (1, 4, 8, 16):
        for k in range(b):
            eng.add_request([100 + k] + prompt[:31], SamplingParams(max_tokens=steps + 4, temperature=0,
                                                                    ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or \
                eng.scheduler.num_waiting:
            eng.step()  # prefills done: time decode steps only
        t0, tokens = time.perf_counter(), 0
        for _ in range(steps):
            tokens += sum(1 for ev in eng.step() if ev.token_id is not None)
        decode[b] = tokens / (time.perf_counter() - t0)
        while eng.has_unfinished():
            eng.step()
    return {"prefill_tokens_per_s": round(prefill, 1), "decode_tokens_per_s": {b: round(v, 1)
                                                                               for b, v in decode.items()}}


def trace_token_means(a: argparse.Namespace) -> tuple[float, float]:
    from tailguard.bench.workloads import load_trace

    rows = [r for r in load_trace(a.trace) if r.t < a.duration * a.speedup + 1e-9]
    ins = [min(a.max_input, max(1, round(r.input_tokens * a.length_scale))) for r in rows]
    outs = [min(a.max_output, max(1, round(r.output_tokens * a.length_scale))) for r in rows]
    return statistics.mean(ins), statistics.mean(outs)


def config_flags(name: str) -> list[str]:
    if name.startswith("static-"):
        return ["--max-num-seqs", str(int(name.removeprefix("static-")))]
    if name in ("forecast", "forecast-cap", "forecast-knee"):
        return ["--batch-cap", "forecast", "--max-num-seqs", "16"]
    raise SystemExit(f"unknown configuration {name!r}: static-N, forecast, forecast-cap or forecast-knee")


class CapPoller(threading.Thread):
    """The cap and token budget the server reports in /metrics, once a second."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = url, [], threading.Event()

    def run(self) -> None:
        import httpx

        t0 = time.monotonic()
        while not self.stop.wait(1.0):
            try:
                text = httpx.get(self.url + "/metrics", timeout=2).text
            except httpx.HTTPError:
                continue
            vals = {}
            for line in text.splitlines():
                for key, g in (("cap", CAP_GAUGE), ("budget", BUDGET_GAUGE)):
                    if line.startswith(g):
                        vals[key] = int(float(line.rsplit(" ", 1)[1]))
            if vals:
                self.samples.append({"t": round(time.monotonic() - t0, 1), **vals})


def run_one(name: str, a: argparse.Namespace, tmp: Path, batch_cap: dict) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg_file = tmp / f"{name}-{port}.yaml"
    cap_cfg = {**batch_cap, "token_budget": "engine"} if name == "forecast-cap" else batch_cap
    if name == "forecast-knee":  # never below the throughput knee: the forecast only widens the cap beyond it
        cap_cfg = {**batch_cap, "min_seqs": a.knee}
    cap_cfg = {k: v for k, v in cap_cfg.items() if k != "throughput_knee"}
    cfg_file.write_text(yaml.safe_dump({"batch_cap": cap_cfg}))
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--port", str(port), "--no-access-log", "--log-level",
           "warning", "--no-slo", "--no-prefix-caching", "--threads", str(a.threads), "--config", str(cfg_file),
           "--store", str(tmp / f"{name}-{port}.sqlite3"), *config_flags(name)]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    poller = None
    try:
        wait_ready(srv, url, name)
        if name.startswith("forecast"):
            poller = CapPoller(url)
            poller.start()
        cpu0 = cpu_seconds(srv.pid)
        out_dir = tmp / f"bench-{name}-{port}"
        bench = [sys.executable, "-m", "tailguard.cli", "bench", "--url", url, "--workload", "trace", "--trace",
                 a.trace, "--trace-speedup", str(a.speedup), "--length-scale", str(a.length_scale),
                 "--duration", str(a.duration), "--max-input-tokens", str(a.max_input), "--max-output-tokens",
                 str(a.max_output), "--output-dir", str(out_dir), "--quiet", "--seed", str(a.seed),
                 "--join", "off", "--no-probe", "--profiles", a.goodput_profile, "--timeout", str(a.timeout)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL, env=env)
        cpu = cpu_seconds(srv.pid) - cpu0
    finally:
        if poller is not None:
            poller.stop.set()
        srv.terminate()
        srv.wait(60)
    res = json.loads((out_dir / "results.json").read_text())
    m, s = res["metrics"], res["summary"]
    out_tokens = res["tokens"]["output_tokens_total"]
    row: dict = {"config": name, "requests": s.get("requests"), "error_rate": s.get("error_rate"),
                 "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                 "cpu_s_per_1k_tokens": 1000 * cpu / out_tokens if out_tokens else None}
    for metric in ("ttft", "e2e"):
        for p in ("p50", "p95", "p99"):
            pct = m[metric]["percentiles"].get(p) or {}
            row[f"{metric}_{p}"] = pct.get("value")
            row[f"{metric}_{p}_ci"] = pct.get("ci")
    verdict = (res.get("slo") or {}).get(a.goodput_profile) or {}
    row["goodput_rps"] = verdict.get("goodput_rps")
    row["goodput_ratio"] = verdict.get("goodput_ratio")
    if poller is not None:
        caps = [x["cap"] for x in poller.samples if "cap" in x]
        row["cap_trajectory"] = poller.samples
        row["cap_min"], row["cap_max"] = (min(caps), max(caps)) if caps else (None, None)
        row["cap_mean"] = statistics.mean(caps) if caps else None
    return row


def fmt(v: float | None, unit: str = "s", scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}{(' ' + unit) if unit else ''}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="static-2,static-4,static-8,static-16,forecast")
    p.add_argument("--trace", default="conv")
    p.add_argument("--speedup", type=float, default=0.5)
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--max-input", type=int, default=1536)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--goodput-profile", default="baseline", help="the SLO profile whose per-request bounds define "
                                                                  "goodput")
    p.add_argument("--period", type=float, default=3.0, help="forecast period (replay seconds)")
    p.add_argument("--horizon", type=int, default=3)
    p.add_argument("--min-history", type=int, default=10)
    p.add_argument("--forecaster", default="holt-winters")
    p.add_argument("--min-seqs", type=int, default=2)
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results/forecast_cap.json")
    a = p.parse_args()
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    for n in names:
        config_flags(n)
    tmp = Path(tempfile.mkdtemp(prefix="tg-forecast-cap-"))
    load_before = os.getloadavg()
    batch_cap: dict = {}
    if any(n.startswith("forecast") for n in names):
        print("calibrating the engine's throughput ...", flush=True)
        measured = calibrate(a.threads)
        mean_in, mean_out = trace_token_means(a)
        batch_cap = {"period_s": a.period, "horizon": a.horizon, "min_history": a.min_history,
                     "refit_every": a.min_history, "forecaster": a.forecaster, "min_seqs": a.min_seqs,
                     "max_seqs": a.max_seqs, "mean_input_tokens": round(mean_in, 1),
                     "mean_output_tokens": round(mean_out, 1), **measured}
        from tailguard.plan.capacity import ServiceProfile, throughput_cap

        a.knee = throughput_cap(ServiceProfile(mean_in, mean_out, measured["prefill_tokens_per_s"],
                                               measured["decode_tokens_per_s"]), a.min_seqs, a.max_seqs)
        batch_cap["throughput_knee"] = a.knee
        print(f"  {measured}; trace means {mean_in:.0f} in, {mean_out:.0f} out; throughput knee {a.knee}", flush=True)
    rows: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(a.repeats):
        for n in (names if rep % 2 == 0 else list(reversed(names))):
            print(f"[{rep + 1}/{a.repeats}] {n} ...", flush=True)
            rows[n].append(run_one(n, a, tmp, batch_cap))
    table = []
    for n in names:
        runs = rows[n]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]
               if isinstance(runs[0][k], int | float) and not isinstance(runs[0][k], bool)
               and all(r.get(k) is not None for r in runs)}
        table.append({"config": n, **med, "runs": runs})
    statics = [t for t in table if t["config"].startswith("static-") and t.get("e2e_p99") is not None]
    best = min(statics, key=lambda t: t["e2e_p99"]) if statics else None
    worst = max(statics, key=lambda t: t["e2e_p99"]) if statics else None
    verdicts = {}
    for fc in (t for t in table if t["config"].startswith("forecast") and t.get("e2e_p99") is not None):
        if best is None:
            break
        lower_p99 = fc["e2e_p99"] < best["e2e_p99"]
        goodput_ok = (fc.get("goodput_rps") or 0) >= (best.get("goodput_rps") or 0)
        verdicts[fc["config"]] = {
            "best_static": best["config"], "best_static_e2e_p99": best["e2e_p99"], "forecast_e2e_p99": fc["e2e_p99"],
            "p99_change": fc["e2e_p99"] / best["e2e_p99"] - 1, "forecast_goodput_rps": fc.get("goodput_rps"),
            "best_static_goodput_rps": best.get("goodput_rps"), "target_met": bool(lower_p99 and goodput_ok),
            # the best static cap is known only after the fact; a cap fixed in advance may be any of them
            "worst_static": worst["config"], "worst_static_e2e_p99": worst["e2e_p99"]}
    verdict = verdicts.get("forecast")
    print(f"\n{a.repeats} repeat(s), medians; OMP_NUM_THREADS={a.threads}, load average before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print("| config | E2E P50 | E2E P95 | E2E P99 | TTFT P99 | goodput | out tok/s | errors | cap (min-mean-max) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        cap = (f"{t['cap_min']:.0f}-{t['cap_mean']:.1f}-{t['cap_max']:.0f}" if t.get("cap_mean") is not None
               else t["config"].removeprefix("static-"))
        gp = (f"{t['goodput_rps']:.2f} req/s ({t.get('goodput_ratio', 0):.0%})" if t.get("goodput_rps") is not None
              else "-")
        print(f"| {t['config']} | {fmt(t.get('e2e_p50'))} | {fmt(t.get('e2e_p95'))} | {fmt(t.get('e2e_p99'))} | "
              f"{fmt(t.get('ttft_p99'))} | {gp} | {fmt(t.get('output_tokens_per_s'), '', digits=1)} | "
              f"{fmt(t.get('error_rate'), '', 100, 1)}% | {cap} |")
    for name, v in verdicts.items():
        print(f"best static: {v['best_static']} (E2E P99 {v['best_static_e2e_p99']:.2f} s); {name} "
              f"{v['forecast_e2e_p99']:.2f} s ({v['p99_change']:+.0%}); target (lower P99 at equal or "
              f"higher goodput) {'met' if v['target_met'] else 'NOT met'}; worst static: {v['worst_static']} "
              f"({v['worst_static_e2e_p99']:.2f} s)")
    print("\nE2E P99 per round (s): " + "; ".join(
        f"{t['config']} " + "/".join(f"{r['e2e_p99']:.1f}" for r in t["runs"] if r.get("e2e_p99") is not None)
        for t in table))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "benchmark": "forecast_cap", "command": f"OMP_NUM_THREADS={a.threads} python benchmarks/forecast_cap.py "
        f"{' '.join(sys.argv[1:])}", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": vars(a),
        "batch_cap": batch_cap, "table": table, "verdict": verdict, "verdicts": verdicts,
        "load_average": {"before": load_before, "after": os.getloadavg()}}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
