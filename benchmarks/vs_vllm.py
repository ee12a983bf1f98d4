"""tailguard against vLLM's CPU build, one server up at a time, measured by the same client (`tailguard bench`).

    .venv/bin/python benchmarks/vs_vllm.py --quick                        # smoke run, ~6 min (vLLM's start dominates)
    .venv/bin/python benchmarks/vs_vllm.py --duration 45                  # ~14 min; benchmarks/results/vs_vllm.json
    .venv/bin/python benchmarks/vs_vllm.py --servers tailguard --tailguard-args "--max-num-seqs 32" --label seqs32

Each server is started with its defaults, as a user would (vLLM: `--dtype bfloat16` on the Hugging Face directory that
benchmarks/export_hf.py writes from the GGUF; tailguard: `tailguard serve --model smollm2`), warmed up, then measured.
One exception: vLLM's KV cache is set to 1 GiB (``--vllm-kv-gib``; ~46K tokens, tailguard's default holds ~68K), as
its own default reserves most of the host's memory and touches it all. Its thread binding stays at its default
(``auto``: on two CPUs the engine computes on one and leaves the other to its API server):

1. prefill rate: TTFT of single requests (one at a time) of 512 and 1,536 prompt tokens with max_tokens 1, as
   prompt tokens (the server's own count) / TTFT, median of ``--prefill-repeats``;
2. the Azure conv trace's lengths x 1/8 (prompts ~130 tokens, answers ~29, ignore_eos) at each ``--rates`` req/s,
   open-loop Poisson arrivals, ``--duration`` s each: TTFT/ITL/E2E P50/P95/P99, output tokens/s, errors;
3. the highest rate with TTFT P99 <= ``--slo-ttft`` s (failed requests count as misses): the fixed rates of (2)
   bracket it, then shorter runs bisect the bracket for ``--sweep-steps`` steps at most;
4. the peak resident memory of the server's process tree (RSS summed over the server and its children, sampled;
   PSS beside it, which does not count pages the processes share twice).

The report also lists what tailguard chose at start-up (its start-up log's lines on the matrix units prompt rows use
and on the step time budget), so that a run says which paths it measured.

Why the trace is sent as a JSONL workload rather than ``--workload trace``: with ``--rate`` the bench rescales the
trace's own arrival times, which are burstier than Poisson and, over the first minute, offer ~0.6x the nominal rate.
The prompts are the bench's own synthetic text at the trace's lengths, each opened by a serial number: the bench's
trace prompts start at random sentences of one corpus, and requests that happen to share a start share a cached
prefix in both servers, which would measure prefix caching rather than serving. ``--rounds 2`` runs the servers in
the order A B, B A, so drift of the machine's load hits both; the report gives medians over rounds and the ratios
tailguard / vLLM taken within each round.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TAILGUARD = Path(sys.executable).with_name("tailguard")
PCTS = ("p50", "p95", "p99")
# no proxy for 127.0.0.1, whatever the environment says
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with HTTP.open(req, timeout=timeout) as r:
        return json.loads(r.read())


# --- memory of a process tree -----------------------------------------------------------------------------------

class TreeMemory(threading.Thread):
    """Samples RSS and PSS summed over a process and all its descendants (vLLM runs its engine in a child)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_pss = 0.0
        self.last_rss = 0.0
        self.processes = 0
        self.hwm: dict[int, float] = {}  # each process's own peak (VmHWM), the last time it was seen
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = pss = 0.0
        for p in procs:
            try:
                full = p.memory_full_info()
                rss += full.rss / 2**20
                pss += full.pss / 2**20
                status = Path(f"/proc/{p.pid}/status").read_text()
                hwm = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
                self.hwm[p.pid] = int(hwm.split()[1]) / 1024
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, StopIteration):
                continue
        self.processes = max(self.processes, len(procs))
        self.last_rss = rss
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> dict:
        self._stop_event.set()
        self.join(5)
        return {"peak_rss_mib": round(self.peak_rss, 1), "peak_pss_mib": round(self.peak_pss, 1),
                "sum_of_process_peaks_mib": round(sum(self.hwm.values()), 1), "processes": self.processes}


# --- servers ----------------------------------------------------------------------------------------------------

class Server:
    """One server process (and its children) in a session of its own, so that stopping it stops them all."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, workdir: Path) -> None:
        self.name, self.cmd, self.env, self.port, self.workdir = name, cmd, env, port, workdir
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{name}-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, limit_s: float) -> float:
        t0 = time.perf_counter()
        with self.log_path.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.workdir, start_new_session=True)
        last_note = t0
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while starting:\n{tail}")
            try:
                # tailguard answers /v1/models with an empty list while its engine loads
                with HTTP.open(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200 and json.loads(r.read()).get("data"):
                        return time.perf_counter() - t0
            except OSError:
                pass
            now = time.perf_counter()
            if now - t0 > limit_s:
                raise RuntimeError(f"{self.name} not ready after {limit_s:.0f} s (log: {self.log_path})")
            if now - last_note >= 15:  # vLLM compiles its model at start: minutes on two cores
                log(f"  {self.name}: starting, {now - t0:.0f} s")
                last_note = now
            time.sleep(0.5)

    def model(self) -> str:
        with HTTP.open(self.url + "/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["id"]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(10)
        # children that outlive the server (vLLM's engine core) share its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def make_server(name: str, args: argparse.Namespace, workdir: Path) -> Server:
    port = free_port()
    env = {**os.environ}
    if name == "tailguard":
        env["TAILGUARD_HOME"] = str(workdir / "tailguard-home")  # a request store of its own, not the shared one
        cmd = [str(TAILGUARD), "serve", "--model", "smollm2", "--host", "127.0.0.1", "--port", str(port),
               *shlex.split(args.tailguard_args)]
    else:
        env["HF_HUB_OFFLINE"] = "1"  # the model is a local directory: nothing from a hub
        if args.vllm_kv_gib > 0:
            # vLLM's own default here sizes the KV cache to most of RAM (20.4 of 23.6 GiB) and makes it all resident
            env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
        for item in args.vllm_env:
            key, _, value = item.partition("=")
            env[key] = value
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_model,
               "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.vllm_args)]
    return Server(name, cmd, env, port, workdir)


# --- prompts ----------------------------------------------------------------------------------------------------

class Prompts:
    """The bench's synthetic English text at a given token length, each prompt opened by a serial number so that no
    two requests share a cached prefix beyond the chat template."""

    def __init__(self, seed: int) -> None:
        from tailguard.bench.tokens import load_tokenizer
        from tailguard.bench.workloads import Corpus

        self.tok = load_tokenizer("auto")
        self.corpus = Corpus(self.tok, "en", 32768, seed)
        self.rng = random.Random(f"vs_vllm:{seed}")
        self.serial = 0
        self.template_tokens = self._template_overhead()

    def _template_overhead(self) -> int:
        """Tokens the chat template adds around a user message (SmolLM2's default system turn and the markers)."""
        from tailguard.engine.model_store import resolve_model_path
        from tailguard.engine.tokenizer import GGUFTokenizer

        tok = GGUFTokenizer(resolve_model_path("smollm2"))
        text = "one two three"
        return len(tok.encode_chat([{"role": "user", "content": text}])) - len(tok.encode(text))

    def make(self, content_tokens: int) -> str:
        prefix = f"{self.serial}. "
        self.serial += 1
        text, _ = self.corpus.take(max(1, content_tokens - len(self.tok.encode(prefix))), self.rng)
        return prefix + text

    def prefill_file(self, path: Path, prompt_tokens: int, n: int) -> Path:
        """``n`` prompts whose chat prompt (template included) is ~``prompt_tokens`` long, max_tokens 1, after a short
        first one: the bench's probe request sends the first line, which puts it in the server's prefix cache."""
        with path.open("w") as f:
            f.write(json.dumps({"prompt": self.make(32), "max_tokens": 1}) + "\n")
            for _ in range(n):
                f.write(json.dumps({"prompt": self.make(prompt_tokens - self.template_tokens), "max_tokens": 1}) + "\n")
        return path

    def trace_file(self, path: Path, n: int, scale: float) -> Path:
        """The conv trace's first ``n`` (input, output) lengths x ``scale``, as the bench's trace replay scales them."""
        from tailguard.bench.workloads import load_trace

        rows = load_trace("conv")
        with path.open("w") as f:
            for i in range(n):
                r = rows[i % len(rows)]
                n_in, n_out = max(1, round(r.input_tokens * scale)), max(1, round(r.output_tokens * scale))
                f.write(json.dumps({"prompt": self.make(n_in), "max_tokens": n_out}) + "\n")
        return path


# --- the bench --------------------------------------------------------------------------------------------------

def run_bench(server: Server, model: str, out_dir: Path, bench_args: list[str], expect_s: float,
              limit_s: float, memory: TreeMemory) -> tuple[dict, list[dict]]:
    """One `tailguard bench` run; prints progress while it runs; returns results.json and requests.csv's rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(TAILGUARD), "bench", "--url", server.url, "--model", model, "--output-dir", str(out_dir),
           "--join", "off", "--bootstrap", "0", "--quiet", *bench_args]
    (out_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    t0 = time.perf_counter()
    with (out_dir / "bench.log").open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                el = time.perf_counter() - t0
                if el > limit_s:
                    proc.kill()
                    proc.wait()
                    raise RuntimeError(f"bench run over {limit_s:.0f} s: {out_dir}") from None
                log(f"    {el:.0f}/~{expect_s:.0f} s, server tree RSS {memory.last_rss:.0f} MiB")
    if proc.returncode != 0:
        raise RuntimeError(f"bench exited {proc.returncode}: {(out_dir / 'bench.log').read_text()[-2000:]}")
    res = json.loads((out_dir / "results.json").read_text())
    with (out_dir / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    return res, rows


def _num(s: str) -> float | None:
    return float(s) if s not in ("", None) else None


def summarize(res: dict, rows: list[dict], slo_ttft: float) -> dict:
    m, s = res["metrics"], res["summary"]

    def pct(name: str) -> dict[str, float | None]:
        p = m[name].get("percentiles") or {}
        return {q: (p.get(q) or {}).get("value") for q in PCTS}

    measured = [r for r in rows if r["warmup"] == "0"]
    ok = [r for r in measured if r["ok"] == "1"]
    # failed requests are misses of any TTFT bound: P99 with them placed above every value
    ttfts = sorted(_num(r["ttft_s"]) or 0.0 for r in ok) + [math.inf] * (len(measured) - len(ok))
    misses = sum(1 for t in ttfts if t > slo_ttft)
    prompt = [_num(r["prompt_tokens"]) for r in ok if _num(r["prompt_tokens"]) is not None]
    out_tok = [_num(r["output_tokens"]) for r in ok if _num(r["output_tokens"]) is not None]
    return {
        "ttft_s": pct("ttft"), "itl_s": pct("itl"), "e2e_s": pct("e2e"),
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "requests_per_s": s["throughput"]["requests_per_s"],
        "measured": s["requests"]["measured"], "completed": s["requests"]["completed"],
        "failed": s["requests"]["failed"], "errors_by_kind": s.get("errors_by_kind"),
        "duration_s": s["duration_s"],
        "ttft_misses": misses, "ttft_miss_fraction": misses / len(measured) if measured else None,
        "slo_pass": bool(measured) and misses <= 0.01 * len(measured),
        "mean_prompt_tokens": statistics.fmean(prompt) if prompt else None,
        "mean_output_tokens": statistics.fmean(out_tok) if out_tok else None,
    }


# --- one server's measurements ----------------------------------------------------------------------------------

def warm_up(server: Server, model: str, prompts: Prompts) -> None:
    """Untimed requests: first-use costs (graph compilation, lazy buffers) stay out of the measurements."""
    url = server.url + "/v1/chat/completions"
    for n_tokens, max_tokens in ((64, 16), (512, 1), (1536, 1), (128, 8)):
        post_json(url, {"model": model, "messages": [{"role": "user", "content": prompts.make(n_tokens)}],
                        "max_tokens": max_tokens, "temperature": 0}, timeout=300)
    threads = [threading.Thread(target=post_json, args=(url, {
        "model": model, "messages": [{"role": "user", "content": prompts.make(130)}], "max_tokens": 16,
        "temperature": 0}, 300)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def rate_args(jsonl: Path, rate: float, duration: float, seed: int, timeout: float) -> list[str]:
    return ["--workload", "jsonl", "--jsonl", str(jsonl), "--rate", f"{rate:g}", "--arrival", "poisson",
            "--duration", f"{duration:g}", "--warmup-seconds", f"{min(5.0, duration / 6):g}", "--seed", str(seed),
            "--timeout", f"{timeout:g}"]


def measure_server(name: str, rnd: int, args: argparse.Namespace, workdir: Path, prompts: Prompts) -> dict:
    server = make_server(name, args, workdir)
    out: dict[str, Any] = {"server": name, "round": rnd, "command": shlex.join(server.cmd),
                           "env": {k: v for k, v in server.env.items() if k.startswith(("VLLM", "OMP", "HF_"))}}
    log(f"[{name} r{rnd}] starting: {shlex.join(server.cmd)}")
    memory: TreeMemory | None = None
    try:
        out["start_s"] = server.start(args.start_limit)
        memory = TreeMemory(server.proc.pid)
        memory.start()
        model = server.model()
        log(f"[{name} r{rnd}] ready in {out['start_s']:.1f} s (model {model!r}); warming up")
        warm_up(server, model, prompts)
        memory.sample()
        out["idle_rss_mib"] = round(memory.last_rss, 1)
        seed = args.seed + rnd

        out["prefill"] = {}
        for n_tokens in args.prefill_tokens:
            tag = f"{name}-r{rnd}-prefill{n_tokens}"
            log(f"[{name} r{rnd}] prefill, {n_tokens}-token prompts x {args.prefill_repeats}")
            jsonl = prompts.prefill_file(workdir / f"{tag}.jsonl", n_tokens, args.prefill_repeats)
            res, rows = run_bench(server, model, workdir / tag,
                                  ["--workload", "jsonl", "--jsonl", str(jsonl), "--concurrency", "1",
                                   "--warmup-requests", "1", "--num-requests", str(args.prefill_repeats + 1),
                                   "--seed", str(seed),
                                   "--timeout", "300"], expect_s=args.prefill_repeats * n_tokens / 300,
                                  limit_s=900, memory=memory)
            per = [(_num(r["prompt_tokens"]) or _num(r["prompt_tokens_local"]), _num(r["ttft_s"]))
                   for r in rows if r["ok"] == "1" and r["warmup"] == "0"]
            rates = [p / t for p, t in per if p and t]
            out["prefill"][str(n_tokens)] = {
                "ttft_s": [t for _, t in per], "prompt_tokens": [p for p, _ in per], "tokens_per_s": rates,
                "median_ttft_s": statistics.median(t for _, t in per) if per else None,
                "median_tokens_per_s": statistics.median(rates) if rates else None,
                "failed": res["summary"]["requests"]["failed"]}
            log(f"[{name} r{rnd}]   {n_tokens}: TTFT {[round(t, 3) for _, t in per]} s, prompt tokens "
                f"{[int(p) for p, _ in per]}, median {out['prefill'][str(n_tokens)]['median_tokens_per_s'] or 0:.0f}"
                " tokens/s")

        out["rates"] = {}
        for rate in args.rates:
            out["rates"][f"{rate:g}"] = run_rate(server, model, name, rnd, rate, args.duration, args.timeout, seed,
                                                 args, workdir, prompts, memory)
        out["sweep"] = sweep(server, model, name, rnd, seed, args, workdir, prompts, memory, out["rates"])
        memory.sample()
    finally:
        if memory is not None:
            out["memory"] = memory.stop()
        server.stop()
        log(f"[{name} r{rnd}] stopped")
        server_log = server.log_path.read_text(errors="replace")
        kv = re.search(r"KV cache [^\n]*?([\d,]+) tokens", server_log)
        out["kv_cache_tokens"] = int(kv.group(1).replace(",", "")) if kv else None
        # what the engine chose at start-up (its matrix units, its step time budget), so a run says what it ran
        out["engine_settings"] = [m.group(1) for m in re.finditer(
            r"tailguard\.engine: (.*(?:prompt rows on|step time budget).*)", server_log)]
    return out


def run_rate(server: Server, model: str, name: str, rnd: int, rate: float, duration: float, timeout: float,
             seed: int, args: argparse.Namespace, workdir: Path, prompts: Prompts, memory: TreeMemory) -> dict:
    tag = f"{name}-r{rnd}-rate{rate:g}-{duration:g}s"
    log(f"[{name} r{rnd}] trace lengths x {args.length_scale:g}, Poisson {rate:g} req/s for {duration:g} s")
    # enough distinct prompts that the bench never cycles back to one (which the prefix cache would hold)
    jsonl = prompts.trace_file(workdir / f"{tag}.jsonl", int(rate * duration * 1.6) + 50, args.length_scale)
    res, rows = run_bench(server, model, workdir / tag, rate_args(jsonl, rate, duration, seed, timeout),
                          expect_s=duration + 5, limit_s=duration + timeout + 120, memory=memory)
    s = summarize(res, rows, args.slo_ttft)
    s["rate"], s["run_s"] = rate, duration
    log(f"[{name} r{rnd}]   {rate:g} req/s: TTFT P50/P99 {fmt_ms(s['ttft_s']['p50'])}/{fmt_ms(s['ttft_s']['p99'])}"
        f" ms, ITL P99 {fmt_ms(s['itl_s']['p99'])} ms, {s['output_tokens_per_s'] or 0:.1f} output tok/s, "
        f"failed {s['failed']}, TTFT <= {args.slo_ttft:g} s: {'pass' if s['slo_pass'] else 'fail'}")
    return s


def sweep(server: Server, model: str, name: str, rnd: int, seed: int, args: argparse.Namespace, workdir: Path,
          prompts: Prompts, memory: TreeMemory, fixed: dict[str, dict]) -> dict:
    """Bisect the highest rate that passes TTFT P99 <= the bound, from the bracket the fixed rates give."""
    points = [{"rate": v["rate"], "pass": v["slo_pass"], "ttft_p99_s": v["ttft_s"]["p99"],
               "ttft_miss_fraction": v["ttft_miss_fraction"], "run_s": v["run_s"], "source": "fixed"}
              for v in fixed.values()]
    t0 = time.perf_counter()
    for _ in range(args.sweep_steps):
        lo = max((p["rate"] for p in points if p["pass"]), default=None)
        hi = min((p["rate"] for p in points if not p["pass"] and (lo is None or p["rate"] > lo)), default=None)
        if lo is not None and hi is not None and hi / lo <= 1 + args.sweep_resolution:
            break
        if time.perf_counter() - t0 > args.sweep_budget:
            log(f"[{name} r{rnd}] sweep: time budget ({args.sweep_budget:g} s) spent")
            break
        rate = (lo * 1.5 if hi is None else hi / 1.5 if lo is None else (lo + hi) / 2)
        rate = round(rate, 2)
        log(f"[{name} r{rnd}] sweep: bracket [{lo}, {hi}] req/s, trying {rate:g}")
        s = run_rate(server, model, name, rnd, rate, args.sweep_duration, args.sweep_timeout, seed, args,
                     workdir, prompts, memory)
        points.append({"rate": rate, "pass": s["slo_pass"], "ttft_p99_s": s["ttft_s"]["p99"],
                       "ttft_miss_fraction": s["ttft_miss_fraction"], "run_s": s["run_s"], "source": "sweep",
                       "failed": s["failed"], "output_tokens_per_s": s["output_tokens_per_s"]})
    lo = max((p["rate"] for p in points if p["pass"]), default=None)
    hi = min((p["rate"] for p in points if not p["pass"] and (lo is None or p["rate"] > lo)), default=None)
    return {"max_rate": lo, "first_fail": hi, "points": points, "slo": f"TTFT P99 <= {args.slo_ttft:g} s"}


# --- report -----------------------------------------------------------------------------------------------------

def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f}"


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def median_of(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def get(d: dict, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def figures(runs: list[dict]) -> dict[str, Any]:
    """The figures compared, per run: a flat dict of name -> value."""
    out: dict[str, Any] = {}
    for r in runs:
        f: dict[str, Any] = {}
        for n, p in (r.get("prefill") or {}).items():
            f[f"prefill_{n}_tok_s"] = p["median_tokens_per_s"]
            f[f"prefill_{n}_ttft_s"] = p["median_ttft_s"]
        for rate, s in (r.get("rates") or {}).items():
            for m in ("ttft_s", "itl_s", "e2e_s"):
                for q in PCTS:
                    f[f"{rate}:{m}:{q}"] = s[m][q]
            f[f"{rate}:out_tok_s"] = s["output_tokens_per_s"]
            f[f"{rate}:failed"] = s["failed"]
        f["max_rate"] = get(r, "sweep", "max_rate")
        f["peak_rss_mib"] = get(r, "memory", "peak_rss_mib")
        f["peak_pss_mib"] = get(r, "memory", "peak_pss_mib")
        out.setdefault(r["server"], {})[r["round"]] = f
    return out


def aggregate(runs: list[dict], rounds: int) -> dict:
    per = figures(runs)
    med = {srv: {k: median_of([f.get(k) for f in by_round.values()]) for k in next(iter(by_round.values()))}
           for srv, by_round in per.items()}
    ratios: dict[str, Any] = {}
    if "tailguard" in per and "vllm" in per:
        for k in med["tailguard"]:
            rs = []
            for rnd in range(rounds):
                a, b = per["tailguard"].get(rnd, {}).get(k), per["vllm"].get(rnd, {}).get(k)
                if a is not None and b:
                    rs.append(a / b)
            ratios[k] = {"per_round": rs, "median": median_of(rs)}
    return {"medians": med, "ratios_tailguard_over_vllm": ratios}


def targets(agg: dict, args: argparse.Namespace, runs: list[dict]) -> list[tuple[str, str, str]]:
    r = agg["ratios_tailguard_over_vllm"]
    med = agg["medians"].get("tailguard", {})
    rows = []

    def ratio(k: str) -> float | None:
        return (r.get(k) or {}).get("median")

    for n in args.prefill_tokens:
        x = ratio(f"prefill_{n}_tok_s")
        rows.append((f"prefill {n:,} tokens >= 2x vLLM", fmt(x, 2) + "x", verdict(x, lambda v: v >= 2)))
    for rate in ("3.4", "6"):
        x = ratio(f"{rate}:ttft_s:p99")
        rows.append((f"TTFT P99 at {rate} req/s <= 0.5x vLLM", fmt(x, 2) + "x", verdict(x, lambda v: v <= 0.5)))
    itl = med.get("3.4:itl_s:p99")
    rows.append(("ITL P99 at 3.4 req/s <= 100 ms", fmt_ms(itl) + " ms", verdict(itl, lambda v: v <= 0.1)))
    x = ratio("max_rate")
    if x is None and med.get("max_rate") is not None and agg["medians"].get("vllm", {}).get("max_rate") is None:
        x = math.inf  # vLLM met the bound at no rate tried
    bound = rate_ratio_bound(runs)
    rows.append((f"highest rate with TTFT P99 <= {args.slo_ttft:g} s >= 1.5x vLLM", bound + fmt(x, 2) + "x",
                 verdict(x, lambda v: v >= 1.5) if bound != "<= " or (x is not None and x < 1.5) else "n/a"))
    return rows


def verdict(x: float | None, ok) -> str:
    return "n/a" if x is None else ("met" if ok(x) else "missed")


def max_rate_cell(runs: list[dict], server: str, rate: float | None) -> str:
    """The rate, marked as a bound where the sweep found no failing rate above it (or no passing one at all)."""
    sweeps = [r.get("sweep") or {} for r in runs if r["server"] == server]
    if rate is None:
        lowest = min((p["rate"] for sw in sweeps for p in sw.get("points", [])), default=None)
        return "-" if lowest is None else f"< {lowest:g}"
    unbounded = any(sw.get("first_fail") is None for sw in sweeps)
    return (">= " if unbounded else "") + fmt(rate, 2)


def rate_ratio_bound(runs: list[dict]) -> str:
    """'<= ' where only vLLM's highest rate is a lower bound (its sweep never failed), '>= ' where only tailguard's."""
    open_ended = {r["server"] for r in runs if (r.get("sweep") or {}).get("first_fail") is None}
    return {frozenset({"vllm"}): "<= ", frozenset({"tailguard"}): ">= "}.get(frozenset(open_ended), "")


def markdown(result: dict, args: argparse.Namespace) -> str:
    agg = result["aggregate"]
    med, rat = agg["medians"], agg["ratios_tailguard_over_vllm"]
    servers = [s for s in ("tailguard", "vllm") if s in med]
    both = len(servers) == 2

    def ratio(k: str) -> str:
        x = (rat.get(k) or {}).get("median")
        return "" if x is None else f"{x:.2f}x"

    lines = [f"Medians over {args.rounds} round(s); ratios tailguard / vLLM within each round, then their median.", ""]
    head = "| figure | " + " | ".join(servers) + (" | tailguard / vLLM |" if both else " |")
    sep = "| --- | " + " | ".join("---:" for _ in servers) + (" | ---: |" if both else " |")
    lines += ["**Prefill** (single requests, max_tokens 1; prompt tokens / TTFT)", "", head, sep]
    for n in args.prefill_tokens:
        lines.append(f"| {n:,}-token prompt: tokens/s | " + " | ".join(fmt(med[s].get(f"prefill_{n}_tok_s"), 0)
                                                                   for s in servers)
                     + (f" | {ratio(f'prefill_{n}_tok_s')} |" if both else " |"))
        lines.append(f"| {n:,}-token prompt: TTFT ms | " + " | ".join(fmt_ms(med[s].get(f"prefill_{n}_ttft_s"))
                                                                    for s in servers)
                     + (f" | {ratio(f'prefill_{n}_ttft_s')} |" if both else " |"))
    lines += ["", f"**Azure conv trace, lengths x {args.length_scale:g}, ignore_eos, Poisson arrivals, "
              f"{args.duration:g} s each** (latencies in ms)", "",
              "| rate | server | TTFT P50 | P95 | P99 | ITL P50 | P95 | P99 | E2E P50 | P95 | P99 | out tok/s | "
              "failed |", "| ---: | --- | " + " | ".join("---:" for _ in range(11)) + " |"]
    for rate in args.rates:
        k = f"{rate:g}"
        for s in servers:
            cells = [fmt_ms(med[s].get(f"{k}:{m}:{q}")) for m in ("ttft_s", "itl_s", "e2e_s") for q in PCTS]
            lines.append(f"| {k} | {s} | " + " | ".join(cells) + f" | {fmt(med[s].get(f'{k}:out_tok_s'))} | "
                         f"{fmt(med[s].get(f'{k}:failed'), 0)} |")
        if both:
            cells = [ratio(f"{k}:{m}:{q}") for m in ("ttft_s", "itl_s", "e2e_s") for q in PCTS]
            lines.append(f"| {k} | ratio | " + " | ".join(cells) + f" | {ratio(f'{k}:out_tok_s')} | |")
    lines += ["", "**Capacity and memory**", "", head, sep,
              f"| highest rate with TTFT P99 <= {args.slo_ttft:g} s (req/s) | "
              + " | ".join(max_rate_cell(result["runs"], s, med[s].get("max_rate")) for s in servers)
              + (f" | {rate_ratio_bound(result['runs'])}{ratio('max_rate')} |" if both else " |")]
    lines += ["| peak RSS of the process tree (MiB) | " + " | ".join(fmt(med[s].get("peak_rss_mib"), 0)
                                                                   for s in servers)
              + (f" | {ratio('peak_rss_mib')} |" if both else " |"),
              "| peak PSS of the process tree (MiB) | " + " | ".join(fmt(med[s].get("peak_pss_mib"), 0)
                                                                   for s in servers)
              + (f" | {ratio('peak_pss_mib')} |" if both else " |")]
    lines += ["", f"Rates tried (req/s: verdict (TTFT P99 of completed requests); fixed runs {args.duration:g} s, sweep runs "
              f"{args.sweep_duration:g} s):", ""]
    for s_run in result["runs"]:
        pts = ", ".join(f"{p['rate']:g} {'pass' if p['pass'] else 'fail'} ({fmt_ms(p['ttft_p99_s'])} ms)"
                        for p in sorted(get(s_run, "sweep", "points") or [], key=lambda p: p["rate"]))
        lines.append(f"- {s_run['server']} (round {s_run['round']}, KV cache {s_run.get('kv_cache_tokens') or 0:,} "
                     f"tokens, started in {s_run.get('start_s') or 0:.0f} s): {pts}")
        lines += [f"  - start-up: {setting}" for setting in s_run.get("engine_settings") or []]
    if both:
        lines += ["", "**Targets**", "", "| target | tailguard | status |", "| --- | ---: | --- |"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in result["targets"]]
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------------------

def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="tailguard,vllm", help="comma list of tailguard, vllm (run in this order)")
    p.add_argument("--rates", type=floats, default=[3.4, 6.0, 9.0], help="req/s of the fixed-rate runs")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of each fixed-rate run")
    p.add_argument("--quick", action="store_true", help="tiny durations: a smoke run, not a measurement")
    p.add_argument("--rounds", type=int, default=1, help="rounds, the server order reversed in every other one")
    p.add_argument("--tailguard-args", default="", help="extra `tailguard serve` flags, e.g. to A/B engine settings")
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server flags (the default: none beyond bf16)")
    p.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for vLLM (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=4")
    p.add_argument("--vllm-kv-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE in GiB (1: ~46K tokens, tailguard's default holds ~68K; 0: vLLM's "
                        "default, which on this machine reserves and touches 20 GiB of a shared 24)")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--hf-model", default="/tmp/smollm2-hf", help="the model as a Hugging Face directory")
    p.add_argument("--label", default=None, help="names the run and its output file (vs_vllm_LABEL.json)")
    p.add_argument("--output", default=None, help="result JSON (default benchmarks/results/vs_vllm[_LABEL].json)")
    p.add_argument("--prefill-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1536])
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--length-scale", type=float, default=0.125, help="trace lengths x this")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout of the fixed-rate runs")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="the TTFT P99 bound of the capacity sweep, seconds")
    p.add_argument("--sweep-steps", type=int, default=4, help="most sweep runs per server beyond the fixed rates")
    p.add_argument("--sweep-duration", type=float, default=None, help="seconds per sweep run (default duration/2)")
    p.add_argument("--sweep-resolution", type=float, default=0.1, help="stop when first fail / last pass <= 1+this")
    p.add_argument("--sweep-budget", type=float, default=180.0, help="seconds of sweeping per server at most")
    p.add_argument("--start-limit", type=float, default=900.0, help="seconds a server may take to get ready")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers or any(s not in ("tailguard", "vllm") for s in args.servers):
        p.error("--servers takes tailguard and/or vllm")
    if args.quick:
        args.duration = min(args.duration, 8.0)
        args.timeout = min(args.timeout, 20.0)
        args.sweep_steps = min(args.sweep_steps, 1)
        args.sweep_budget = min(args.sweep_budget, 30.0)
    if args.sweep_duration is None:
        args.sweep_duration = max(args.duration / 2, 5.0 if args.quick else 20.0)
    # a request whose TTFT passes the bound tenfold decides nothing more about the bound
    args.sweep_timeout = min(args.timeout, max(10 * args.slo_ttft, 10.0))
    if args.output is None:
        name = "vs_vllm" + (f"_{args.label}" if args.label else "_quick" if args.quick else "")
        args.output = str(RESULTS / f"{name}.json")
    return args


def versions(args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    with contextlib.suppress(OSError, StopIteration):
        out["cpu"] = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name"))
    out["logical_cpus"] = os.cpu_count()
    for key, cmd in (("tailguard_commit", ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
                     ("vllm", [args.vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"])):
        try:
            out[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out[key] = None
    try:
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60).stdout
        out["tailguard_uncommitted_files"] = [line[3:] for line in dirty.splitlines()]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def main() -> None:
    args = parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path(f"/tmp/vs_vllm-{stamp}" + (f"-{args.label}" if args.label else ""))
    workdir.mkdir(parents=True)
    per_server = (len(args.prefill_tokens) * 10 + len(args.rates) * (args.duration + 10)
                  + min(args.sweep_budget, args.sweep_steps * (args.sweep_duration + 10)))
    log(f"vs_vllm: servers {args.servers}, {args.rounds} round(s), rates {args.rates} x {args.duration:g} s; "
        f"~{per_server / 60:.0f} min of measuring per server and round, plus start-ups; work files in {workdir}")
    prompts = Prompts(args.seed)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    load_start = os.getloadavg()
    runs = []
    for rnd in range(args.rounds):
        order = args.servers if rnd % 2 == 0 else args.servers[::-1]
        for name in order:
            runs.append(measure_server(name, rnd, args, workdir, prompts))
    result: dict[str, Any] = {
        "benchmark": "vs_vllm", "label": args.label, "quick": args.quick, "date": started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "load_average": {"start": load_start, "end": os.getloadavg()}, "versions": versions(args),
        "settings": {k: v for k, v in vars(args).items()}, "template_tokens": prompts.template_tokens,
        "workdir": str(workdir), "runs": runs}
    result["aggregate"] = aggregate(runs, args.rounds)
    result["targets"] = targets(result["aggregate"], args, runs) if len(set(args.servers)) == 2 else []
    table = markdown(result, args)
    result["markdown"] = table
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print()
    print(table)
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
