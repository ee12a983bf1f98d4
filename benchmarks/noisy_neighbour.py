#!/usr/bin/env python
"""The demo's load on a server that shares its cores: with and without a CPU-bound neighbour, per thread setting.

Issue 28 (item 10): ``tailguard demo`` on two cores gave bench E2E P99 of 9.9-15 s for 32-token answers at 0.2 req/s
with OpenMP's default (its threads poll ~5 ms after each of a step's ~120 parallel regions, so they never slept while
the server ran), 1.1 s with OMP_WAIT_POLICY=passive, which halves quiet single-stream decode instead. This measures:

1. serving: ``tailguard serve --model smollm2`` in a subprocess on 127.0.0.1, and from this process (the load
   generator, on the same cores, as in the demo) the demo's load: a burst of concurrent streaming chat requests
   (demo.DEMO_PROMPTS, 48 tokens) then an open-loop Poisson bench run (64-token en/zh prompts, 32-token answers).
   Each setting's server runs it quiet and with a neighbour (a busy-loop Python process, pinned nowhere), the two
   alternating in order from round to round; the settings rotate too. Besides the latencies: the CPU seconds the
   server burns per 1k output tokens, the share of a core the neighbour got, and the cores that other processes on
   the host (other users' jobs) kept busy meanwhile: "quiet" is only as quiet as that column. A request past
   --timeout (20 s) is cut off and counts at 20 s, a lower bound (a collapsing setting would take minutes a run).
2. single-stream decode tokens/s: one engine process switching the kernels' pool between runs
   (kernels.set_thread_pool), old default / new default / best alternating for --decode-seconds; the medians are of
   the runs during which other processes kept under 0.1 cores busy (all runs' medians are printed too).

Settings (the server's environment; OMP_*, GOMP_* and TAILGUARD_* thread variables are cleared first):
    new default   nothing set: the kernels' own pool, polling DEFAULT_SPIN_US (engine/threads.py)
    old default   TAILGUARD_THREAD_POOL=openmp: libgomp's pool with its own defaults (before this change)
    passive       TAILGUARD_THREAD_POOL=openmp OMP_WAIT_POLICY=passive (the issue's workaround)
    best          the best other setting found (BEST below: the own pool, never polling)

    .venv/bin/python benchmarks/noisy_neighbour.py             # ~9 minutes: 2 rounds
    .venv/bin/python benchmarks/noisy_neighbour.py --quick     # a smoke run (~3 minutes)

Prints a table and writes benchmarks/results/noisy_neighbour.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_DYNAMIC",
               "TAILGUARD_THREAD_POOL", "TAILGUARD_SPIN_US")
# The best other setting found with --setting (the own pool polling 0, 30, 300 or 1000 us; one thread; passive):
# no polling was the fastest beside a busy-loop neighbour in single-stream decode (the new default stops polling
# while it sees contention), within noise of the others in serving.
BEST = {"TAILGUARD_SPIN_US": "0"}
SETTINGS: dict[str, dict[str, str]] = {
    "new default": {},
    "old default": {"TAILGUARD_THREAD_POOL": "openmp"},
    "passive": {"TAILGUARD_THREAD_POOL": "openmp", "OMP_WAIT_POLICY": "passive"},
    "best": BEST,
}
NEIGHBOUR = "while True:\n    pass\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_busy_seconds() -> float:
    """CPU seconds the whole host has spent busy (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(extra)
    return env


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


# --- the server -----------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, setting: str, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--model", "smollm2", "--host", "127.0.0.1", "--port",
               str(self.port), "--no-access-log", "--log-level", "warning",
               "--store", str(tmp / f"requests-{self.port}.sqlite3")]
        self.log = tmp / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"),
                                     env=clean_env(SETTINGS[setting]))

    def wait_ready(self, timeout: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not get ready")
            time.sleep(0.3)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- the demo's load ------------------------------------------------------------------------------------------------
async def burst(url: str, n: int, max_tokens: int, timeout: float) -> dict[str, Any]:
    """The demo's burst: n concurrent streaming chat requests (its prompts), all sent at once. A request still
    streaming after ``timeout`` is cut off and counts at ``timeout`` (a lower bound), with the chunks it got."""
    import httpx

    from tailguard.demo import DEMO_PROMPTS

    async def one(client: httpx.AsyncClient, i: int) -> tuple[float, int, bool]:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": DEMO_PROMPTS[i % len(DEMO_PROMPTS)]}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        tokens = chunks = 0

        async def read() -> None:
            nonlocal tokens, chunks
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"burst request {i}: HTTP {resp.status_code}")
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        chunks += any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]

        try:
            await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            return timeout, chunks, True
        return time.perf_counter() - t0, tokens, False

    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout + 5, limits=limits) as client:
        done = await asyncio.gather(*(one(client, i) for i in range(n)))
    wall = time.perf_counter() - t0
    e2e = [d for d, _, _ in done]
    tokens = sum(t for _, t, _ in done)
    return {"requests": n, "output_tokens": tokens, "timed_out": sum(c for _, _, c in done), "wall_s": wall,
            "tokens_per_s": tokens / wall, "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99)}


def bench(url: str, tokenizer, requests: int, rate: float, seed: int, timeout: float) -> dict[str, Any]:
    """The demo's bench run: open-loop Poisson, 64-token en/zh prompts, 32-token answers. A request that fails (past
    ``timeout``) counts in E2E at ``timeout``, a lower bound."""
    from tailguard.bench.runner import BenchConfig, execute

    cfg = BenchConfig(url=url, model="smollm2", rate=rate, num_requests=requests, input_tokens=64, output_tokens=32,
                      langs=("en", "zh"), warmup_requests=2, business_type="demo", bootstrap=50, seed=seed,
                      progress=False, probe=False, join="off", label="noisy-neighbour", timeout=timeout)
    results, ms = asyncio.run(execute(cfg, tokenizer=tokenizer, display=False))
    measured = [m for m in ms if not m.warmup and m.ok]
    failed = sum(1 for m in ms if not m.warmup and not m.ok)
    e2e = [m.e2e for m in measured if m.e2e is not None] + [timeout] * failed
    ttft = [m.ttft for m in measured if m.ttft is not None]
    itl = [g for m in measured for g in m.itl]
    return {"requests": len(ms) - sum(m.warmup for m in ms), "ok": len(measured), "failed": failed,
            "output_tokens": sum(m.output_tokens or 0 for m in ms),
            "e2e_s": e2e, "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "output_tokens_per_s": results["summary"]["throughput"].get("output_tokens_per_s")}


def run_condition(server: Server, neighbour: bool, a: argparse.Namespace, tokenizer, seed: int) -> dict[str, Any]:
    hog = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if neighbour else None
    try:
        if hog is not None:
            time.sleep(0.5)  # running, not starting
        hog_cpu0 = cpu_seconds(hog.pid) if hog is not None else 0.0
        cpu0, own0, host0 = cpu_seconds(server.proc.pid), time.process_time(), host_busy_seconds()
        t0 = time.perf_counter()
        b = asyncio.run(burst(server.url, a.burst, a.burst_tokens, a.timeout))
        s = bench(server.url, tokenizer, a.bench_requests, a.rate, seed, a.timeout)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(server.proc.pid) - cpu0
        hog_cpu = cpu_seconds(hog.pid) - hog_cpu0 if hog is not None else 0.0
        hog_share = hog_cpu / wall if hog is not None else None
        # whatever else ran on the host meanwhile (other users' jobs): "quiet" is only as quiet as this
        others = host_busy_seconds() - host0 - cpu - hog_cpu - (time.process_time() - own0)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    tokens = b["output_tokens"] + s["output_tokens"]
    return {"burst": b, "bench": s, "wall_s": wall, "server_cpu_s": cpu,
            "server_cpu_s_per_1k_tokens": 1000 * cpu / tokens if tokens else None,
            "server_cores_busy": cpu / wall, "neighbour_core_share": hog_share,
            "other_processes_cores_busy": max(0.0, others / wall)}


# --- single-stream decode ---------------------------------------------------------------------------------------------
CLEAN_OTHERS = 0.1  # a decode sample counts as quiet when other processes kept less than this many cores busy


def decode_worker(seconds: int, best_spin_us: int) -> None:
    """(In a subprocess with a clean environment.) Single-stream greedy decode, 64 tokens after a short chat prompt,
    prefill included, old default (OpenMP) / new default / best alternating in one process for ``seconds``; each
    sample with the cores other processes kept busy meanwhile. JSON on stdout."""
    from tailguard.engine import kernels, threads
    from tailguard.engine.engine import EngineArgs, LLMEngine
    from tailguard.engine.sequence import SamplingParams

    eng = LLMEngine(EngineArgs(model="smollm2"))
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": "Write a short story about a robot who paints."}])
    configs = {"old default": ("openmp", 0), "new default": ("tailguard", threads.DEFAULT_SPIN_US),
               "best": ("tailguard", best_spin_us)}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.generate([ids], warm)
    deadline, r = time.monotonic() + seconds, 0
    while time.monotonic() < deadline or r < 2:
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            pool, spin = configs[name]
            kernels.set_thread_pool(pool)
            kernels.set_spin_us(spin)
            eng.generate([ids], warm)
            host0, own0, t0 = host_busy_seconds(), time.process_time(), time.perf_counter()
            eng.generate([ids], SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
            wall = time.perf_counter() - t0
            others = (host_busy_seconds() - host0 - (time.process_time() - own0)) / wall
            samples[name].append((64 / wall, max(0.0, others)))
        r += 1
    print(json.dumps({"samples": samples, "threads": kernels.thread_settings_loaded().threads}))


def run_decode(seconds: float) -> dict[str, Any]:
    best_spin = int(BEST.get("TAILGUARD_SPIN_US", "100"))
    out = subprocess.run([sys.executable, __file__, "--decode-worker", str(int(seconds)), str(best_spin)],
                         capture_output=True, text=True, env=clean_env({}), check=True)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    samples = data["samples"]
    every = {k: statistics.median(r for r, _ in v) for k, v in samples.items()}
    clean = {k: [r for r, o in v if o < CLEAN_OTHERS] for k, v in samples.items()}
    quiet = {k: statistics.median(v) if len(v) >= 3 else None for k, v in clean.items()}

    def ratio(d: dict[str, float | None], a: str, b: str) -> float | None:
        return d[a] / d[b] if d[a] and d[b] else None

    return {"seconds": seconds, "threads": data["threads"], "samples_tokens_per_s_and_other_cores": samples,
            "median_tokens_per_s_all": every, "quiet_samples": {k: len(v) for k, v in clean.items()},
            "median_tokens_per_s_quiet": quiet,
            "new_over_old": ratio(quiet, "new default", "old default"),
            "best_over_old": ratio(quiet, "best", "old default"),
            "new_over_old_all_samples": ratio(every, "new default", "old default")}


# --- report ---------------------------------------------------------------------------------------------------------
def summarise(runs: list[dict[str, Any]], settings: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for setting in settings:
        for cond in ("quiet", "neighbour"):
            rs = [r for r in runs if r["setting"] == setting and r["condition"] == cond]
            if not rs:
                continue
            pooled = [x for r in rs for x in r["bench"]["e2e_s"]]
            out[f"{setting} / {cond}"] = {
                "rounds": len(rs),
                "e2e_p50_s": median([r["bench"]["e2e_p50_s"] for r in rs]),
                "e2e_p99_s": median([r["bench"]["e2e_p99_s"] for r in rs]),
                "e2e_p99_pooled_s": pct(pooled, 99),
                "ttft_p99_s": median([r["bench"]["ttft_p99_s"] for r in rs]),
                "itl_p50_s": median([r["bench"]["itl_p50_s"] for r in rs]),
                "itl_p99_s": median([r["bench"]["itl_p99_s"] for r in rs]),
                "burst_tokens_per_s": median([r["burst"]["tokens_per_s"] for r in rs]),
                "burst_e2e_p99_s": median([r["burst"]["e2e_p99_s"] for r in rs]),
                "server_cpu_s_per_1k_tokens": median([r["server_cpu_s_per_1k_tokens"] for r in rs]),
                "neighbour_core_share": median([r["neighbour_core_share"] for r in rs]),
                "other_processes_cores_busy": median([r["other_processes_cores_busy"] for r in rs]),
            }
    return out


def ratios(summary: dict[str, Any], decode: dict[str, Any] | None) -> dict[str, Any]:
    def get(key: str, field: str = "e2e_p99_s") -> float | None:
        return (summary.get(key) or {}).get(field)

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    r: dict[str, Any] = {
        "new default: neighbour / quiet E2E P99": div(get("new default / neighbour"), get("new default / quiet")),
        "new default / best, with the neighbour, E2E P99": div(get("new default / neighbour"),
                                                                get("best / neighbour")),
        "old default: neighbour / quiet E2E P99": div(get("old default / neighbour"), get("old default / quiet")),
        "old / new default, with the neighbour, E2E P99": div(get("old default / neighbour"),
                                                               get("new default / neighbour")),
    }
    if decode is not None:
        r["quiet decode new / old default"] = decode["new_over_old"]
    targets = {
        "new default neighbour/quiet E2E P99 <= 1.5": r["new default: neighbour / quiet E2E P99"],
        "new default/best neighbour E2E P99 <= 1.2": r["new default / best, with the neighbour, E2E P99"],
        "quiet decode new/old >= 0.95": r.get("quiet decode new / old default"),
    }
    limits = {"new default neighbour/quiet E2E P99 <= 1.5": (1.5, "le"),
              "new default/best neighbour E2E P99 <= 1.2": (1.2, "le"), "quiet decode new/old >= 0.95": (0.95, "ge")}
    r["targets"] = {k: (None if v is None else (v <= limits[k][0] if limits[k][1] == "le" else v >= limits[k][0]))
                    for k, v in targets.items()}
    return r


def print_report(summary: dict[str, Any], rat: dict[str, Any], decode: dict[str, Any] | None, rounds: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    t = Table(title=f"demo load per setting, quiet vs a busy-loop neighbour (medians of {rounds} rounds)")
    for col in ("setting / condition", "E2E P50", "E2E P99", "pooled P99", "TTFT P99", "ITL P99", "burst tok/s",
                "burst P99", "CPU s/1k tok", "neighbour core", "others' cores"):
        t.add_column(col, justify="left" if col.startswith("setting") else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    for key, s in summary.items():
        t.add_row(key, ms(s["e2e_p50_s"]), ms(s["e2e_p99_s"]), ms(s["e2e_p99_pooled_s"]), ms(s["ttft_p99_s"]),
                  ms(s["itl_p99_s"]), f"{s['burst_tokens_per_s']:.0f}", ms(s["burst_e2e_p99_s"]),
                  f"{s['server_cpu_s_per_1k_tokens']:.1f}",
                  "-" if s["neighbour_core_share"] is None else f"{s['neighbour_core_share']:.2f}",
                  f"{s['other_processes_cores_busy']:.2f}")
    console.print(t)
    if decode is not None:
        quiet, n = decode["median_tokens_per_s_quiet"], decode["quiet_samples"]
        console.print(f"single-stream decode, {decode['threads']} threads, settings alternating for "
                      f"{decode['seconds']:.0f} s; medians of the samples with other processes under "
                      f"{CLEAN_OTHERS} cores: " + ", ".join(
                          f"{k} {'-' if v is None else f'{v:.1f}'} tok/s (n={n[k]})" for k, v in quiet.items()))
        console.print("  all samples: " + ", ".join(
            f"{k} {v:.1f} tok/s" for k, v in decode["median_tokens_per_s_all"].items()))
    for k, v in rat.items():
        if k != "targets" and v is not None:
            console.print(f"{k}: {v:.2f}")
    for k, v in rat["targets"].items():
        console.print(f"target {k}: {'-' if v is None else ('met' if v else 'MISSED')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every setting x condition (default 2)")
    p.add_argument("--settings", default=None, help="comma-separated subset of " + ", ".join(SETTINGS)
                   + " and of --setting's names (default: all)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                   help="another setting to try, e.g. 'spin 0:TAILGUARD_SPIN_US=0' (repeatable)")
    p.add_argument("--conditions", default="quiet,neighbour", help="quiet, neighbour or both (the default)")
    p.add_argument("--burst", type=int, default=8, help="concurrent requests of the burst (the demo sends 16)")
    p.add_argument("--burst-tokens", type=int, default=48, help="max_tokens of the burst's requests (the demo's)")
    p.add_argument("--bench-requests", type=int, default=16, help="measured bench requests a run (the demo sends 20)")
    p.add_argument("--rate", type=float, default=1.0,
                   help="bench arrival rate, req/s (the demo's 0.3 would take a minute a run; 1.0 still leaves the "
                        "server mostly idle between arrivals)")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="a request still running after this many seconds is cut off and counts at it (a lower bound): "
                        "keeps a collapsing setting from taking minutes")
    p.add_argument("--decode-seconds", type=float, default=60.0,
                   help="how long the single-stream decode comparison alternates its settings")
    p.add_argument("--no-decode", action="store_true", help="skip the single-stream decode comparison")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 4-request burst, 6 bench requests")
    p.add_argument("--out", default=str(ROOT / "results" / "noisy_neighbour.json"))
    p.add_argument("--decode-worker", nargs=2, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.decode_worker:
        decode_worker(*a.decode_worker)
        return
    if a.quick:
        a.rounds, a.burst, a.bench_requests, a.decode_seconds = 1, 4, 6, 15
    for spec in a.setting:
        name, _, assignments = spec.partition(":")
        SETTINGS[name.strip()] = dict(kv.split("=", 1) for kv in assignments.split(",") if kv.strip())
    settings = [s.strip() for s in (a.settings or ",".join(SETTINGS)).split(",") if s.strip()]
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        p.error(f"unknown settings {sorted(unknown)}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tailguard.bench.tokens import load_tokenizer

    tokenizer = load_tokenizer("auto")
    runs: list[dict[str, Any]] = []
    decode = None
    conditions = [c.strip() for c in a.conditions.split(",") if c.strip()]
    if not conditions or set(conditions) - {"quiet", "neighbour"}:
        p.error("--conditions: quiet, neighbour or both")
    total = a.rounds * len(settings) * len(conditions) + (0 if a.no_decode else 1)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    started = time.time()
    with tempfile.TemporaryDirectory() as tmpdir, Progress(*columns) as progress:
        task = progress.add_task("noisy neighbour", total=total)
        tmp = Path(tmpdir)
        if not a.no_decode:
            progress.update(task, description="single-stream decode")
            decode = run_decode(a.decode_seconds)
            progress.advance(task)
        for r in range(a.rounds):
            order = settings[r % len(settings):] + settings[: r % len(settings)]
            for setting in order:
                progress.update(task, description=f"round {r + 1}: {setting}: starting")
                server = Server(setting, tmp)
                try:
                    server.wait_ready()
                    asyncio.run(burst(server.url, 2, 8, a.timeout))  # warm-up
                    for cond in conditions if r % 2 == 0 else conditions[::-1]:
                        progress.update(task, description=f"round {r + 1}: {setting} / {cond}")
                        res = run_condition(server, cond == "neighbour", a, tokenizer, seed=r)
                        runs.append({"round": r, "setting": setting, "condition": cond, **res})
                        progress.advance(task)
                finally:
                    server.stop()
    summary = summarise(runs, settings)
    rat = ratios(summary, decode)
    print_report(summary, rat, decode, a.rounds)
    out = {
        "benchmark": "noisy_neighbour",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_unix": started, "elapsed_s": time.time() - started,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "affinity": len(os.sched_getaffinity(0)), "processor": platform.processor()},
        "load": {"burst_requests": a.burst, "burst_max_tokens": a.burst_tokens, "bench_requests": a.bench_requests,
                 "bench_rate": a.rate, "bench_input_tokens": 64, "bench_output_tokens": 32, "langs": ["en", "zh"],
                 "rounds": a.rounds, "timeout_s": a.timeout,
                 "decode_seconds": None if a.no_decode else a.decode_seconds},
        "settings": {s: SETTINGS[s] for s in settings},
        "summary": summary, "ratios": rat, "decode": decode,
        "runs": [{**r, "bench": {k: v for k, v in r["bench"].items() if k != "e2e_s"},
                  "bench_e2e_s": r["bench"]["e2e_s"]} for r in runs],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
