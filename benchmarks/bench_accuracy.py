"""How close ``tailguard bench`` (and GuideLLM, AIPerf where installed) comes to a known truth: TTFT and ITL p50.

The fake server (``tailguard bench fake-server``'s code, in its own process, uvloop) is scripted with a fixed TTFT and
inter-token gap; every tool runs the same closed-loop load against it, alternating tool by tool so that all of them
see the same minutes of a shared, noisy machine. Besides each tool's own figures, the server's own records say what
it really did for those requests (``time.perf_counter()`` when each chunk was handed to the socket): that separates
a drifting server (its gaps or its lateness against the absolute schedule growing) from a client that timestamps
late. Medians over the repeats are reported.

Truth: the script's TTFT (request parsed -> first token written) and ITL (gap between chunks). A client adds the
loopback trip and its own send path to TTFT, so a few tenths of a millisecond above the script is the floor.

    .venv/bin/python benchmarks/bench_accuracy.py [--repeats 3] [--requests 64] [--tools tailguard,guidellm,aiperf]

GuideLLM and AIPerf are looked up in /tmp/guidellm-venv and /tmp/aiperf-venv (or --guidellm/--aiperf, or PATH);
install each in its own venv (``python3 -m venv /tmp/guidellm-venv && /tmp/guidellm-venv/bin/pip install guidellm``),
never in the project's. Both need a Hugging Face tokenizer for their synthetic prompts: a small word-level one is
written to a temporary folder, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.bench.fakeserver import FakeScript, FakeServerProcess

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "bench_accuracy.json"

# ``tailguard bench`` through the bench's own argument parser and runner (what the CLI calls), in a fresh process
# like the other tools, without depending on the top-level CLI module.
_TAILGUARD_DRIVER = (
    "import argparse, sys\n"
    "from tailguard.bench.cli import add_bench_parser, run_bench\n"
    "p = argparse.ArgumentParser(prog='tailguard')\n"
    "add_bench_parser(p.add_subparsers(dest='command'))\n"
    "sys.exit(run_bench(p.parse_args(['bench', *sys.argv[1:]])))\n"
)


def _find(name: str, explicit: str | None, venv: str) -> str | None:
    for cand in (explicit, f"{venv}/bin/{name}", shutil.which(name)):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _write_tokenizer(folder: Path) -> Path:
    """A word-level Hugging Face tokenizer (whitespace split): enough for synthetic prompts, no download."""
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(4000)]
    special = [{"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for i, w in enumerate(words[:3])]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special, "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
           "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
           "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "[UNK]"}}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1_000_000}))
    return folder


def _records(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/_fake/records", timeout=60) as r:
        return json.loads(r.read())


def server_side(recs: list[dict], script: FakeScript, tokens: int) -> dict:
    """What the fake server itself did for one run's measured requests (its own clock)."""
    ttft, gaps, per_req, late, late_last = [], [], [], [], []
    for r in recs:
        c = r.get("_clock") or {}
        sent = c.get("chunk_sent") or []
        if not r.get("stream") or r.get("output_tokens") != tokens or len(sent) < 2:
            continue  # probes, warm-ups, non-streamed or short answers
        t0 = c["received"]
        ttft.append(sent[0] - t0)
        d = np.diff(sent)
        gaps.extend(d.tolist())
        per_req.append(float(d.mean()))
        # lateness of each chunk against the absolute schedule; a server that sleeps gap by gap instead of to
        # deadlines shows it growing along the answer
        sched = t0 + script.ttft + script.itl * np.arange(len(sent))
        lat = np.asarray(sent) - sched
        late.extend(lat.tolist())
        late_last.append(float(lat[-1]))
    if not ttft:
        return {"requests": 0}
    ms = lambda v: round(float(v) * 1e3, 4)  # noqa: E731
    return {"requests": len(ttft), "ttft_p50_ms": ms(np.median(ttft)), "itl_p50_ms": ms(np.median(gaps)),
            "itl_mean_ms": ms(np.mean(gaps)), "itl_per_request_mean_p50_ms": ms(np.median(per_req)),
            "lateness_p50_ms": ms(np.median(late)), "lateness_last_chunk_p50_ms": ms(np.median(late_last))}


def run_tailguard(url: str, a: argparse.Namespace, work: Path, client: str, src: str | None = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"tailguard-{client}-", dir=work))
    env = None
    if src:  # another source tree of tailguard (an old commit, for a before/after in the same minutes)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-c", _TAILGUARD_DRIVER, "--url", url, "--model", "fake", "--concurrency",
           str(a.concurrency), "--num-requests", str(a.requests), "--input-tokens", str(a.input_tokens),
           "--output-tokens", str(a.output_tokens), "--http-client", client,
           "--bootstrap", "0", "--join", "off", "--profiles", "baseline", "--output-dir", str(out), "--quiet"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=a.timeout, env=env)
    results = json.loads((out / "results.json").read_text())
    m = results["metrics"]
    p50 = lambda k: m[k]["percentiles"]["p50"]["value"] * 1e3  # noqa: E731
    lag = ((results.get("bench_health") or {}).get("send_lag_s") or {}).get("p50")
    return {"ttft_p50_ms": p50("ttft"), "itl_p50_ms": p50("itl"), "tpot_p50_ms": p50("tpot"),
            # intended send -> the request handed to the HTTP client: bench time inside every TTFT
            "send_lag_p50_ms": None if lag is None else lag * 1e3,
            "itl_definition": "p50 of every gap between content chunks, pooled over requests"}


def run_guidellm(exe: str, url: str, a: argparse.Namespace, work: Path, tok: Path) -> dict:
    out = work / "guidellm.json"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model=fake,request_format=/v1/chat/completions",
           "--profile", f"kind=concurrent,streams={a.concurrency}",
           "--constraint", f"kind=max_requests,count={a.requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={a.input_tokens},output_tokens={a.output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tok}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=a.timeout)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    return {"ttft_p50_ms": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_p50_ms": m["inter_token_latency_ms"]["successful"]["median"],
            "tpot_p50_ms": m["time_per_output_token_ms"]["successful"]["median"],
            "itl_definition": "p50 over requests of (last token - first token) / (tokens - 1)"}


def run_aiperf(exe: str, url: str, a: argparse.Namespace, work: Path, tok: Path) -> dict:
    out = work / "aiperf"
    cmd = [exe, "profile", "--model", "fake", "--url", url, "--endpoint-type", "chat", "--streaming",
           "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
           "--prompt-input-tokens-mean", str(a.input_tokens), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(a.output_tokens), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{a.output_tokens}",
           "--tokenizer", str(tok), "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics",
           "--no-gpu-telemetry"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=a.timeout)
    m = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"ttft_p50_ms": m["time_to_first_token"]["p50"], "itl_p50_ms": m["inter_token_latency"]["p50"],
            "itl_definition": "p50 over requests of (request latency - TTFT) / (tokens - 1)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ttft", type=float, default=0.150, help="scripted TTFT (s)")
    p.add_argument("--itl", type=float, default=0.020, help="scripted gap between chunks (s)")
    p.add_argument("--spin", type=float, default=0.001, help="fake server's spin (the fake-server CLI default)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tools", default="tailguard,guidellm,aiperf",
                   help="comma list of tailguard, tailguard-httpx, guidellm, aiperf; tailguard@SRC (or "
                        "tailguard-httpx@SRC) runs the tailguard source tree at SRC, e.g. an old commit's "
                        "(git archive COMMIT src | tar -x -C /tmp/old; tailguard@/tmp/old/src)")
    p.add_argument("--guidellm", help="guidellm executable (default /tmp/guidellm-venv/bin/guidellm or PATH)")
    p.add_argument("--aiperf", help="aiperf executable (default /tmp/aiperf-venv/bin/aiperf or PATH)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one tool run may take")
    p.add_argument("--label", default="", help="a name for this set of figures (stored in the JSON)")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)

    wanted = [t.strip() for t in a.tools.split(",") if t.strip()]
    exes = {"guidellm": _find("guidellm", a.guidellm, "/tmp/guidellm-venv"),
            "aiperf": _find("aiperf", a.aiperf, "/tmp/aiperf-venv")}
    tools, skipped = [], {}
    for t in wanted:
        base, _, src = t.partition("@")
        if base not in ("tailguard", "tailguard-aiohttp", "tailguard-httpx", "guidellm", "aiperf") or (
                src and not base.startswith("tailguard")):
            p.error(f"unknown tool {t!r}")
        if src and not Path(src, "tailguard", "bench", "runner.py").is_file():
            skipped[t] = f"no tailguard source tree at {src}"
        elif t in exes and exes[t] is None:
            skipped[t] = "not installed"
        else:
            tools.append(t)
    script = FakeScript(ttft=a.ttft, itl=a.itl, spin=a.spin, max_lifetime=3600.0, keep_records=100_000)
    runs: dict[str, list[dict]] = {t: [] for t in tools}
    with tempfile.TemporaryDirectory(prefix="bench-accuracy-") as tmp, FakeServerProcess(script) as srv:
        work = Path(tmp)
        tok = _write_tokenizer(work / "tokenizer")
        for rep in range(a.repeats):
            for tool in tools:  # alternate: every tool sees the same minutes
                before = len(_records(srv.url))
                t = time.perf_counter()
                try:
                    if tool.startswith("tailguard"):
                        name, _, src = tool.partition("@")
                        fig = run_tailguard(srv.url, a, work / f"r{rep}", name.partition("-")[2] or "aiohttp",
                                            src or None)
                    elif tool == "guidellm":
                        fig = run_guidellm(exes["guidellm"], srv.url, a, work / f"r{rep}", tok)
                    else:
                        fig = run_aiperf(exes["aiperf"], srv.url, a, work / f"r{rep}", tok)
                except (subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
                    print(f"{tool} run {rep + 1} failed: {exc}", file=sys.stderr)
                    skipped.setdefault(tool, f"a run failed: {str(exc)[:200]}")
                    continue
                fig["wall_s"] = round(time.perf_counter() - t, 2)
                fig["server"] = server_side(_records(srv.url)[before:], script, a.output_tokens)
                runs[tool].append(fig)
                print(f"  run {rep + 1} {tool:15s} TTFT p50 {fig['ttft_p50_ms']:8.3f} ms  ITL p50 "
                      f"{fig['itl_p50_ms']:7.3f} ms   (server: TTFT {fig['server'].get('ttft_p50_ms')} "
                      f"ITL {fig['server'].get('itl_p50_ms')})", flush=True)

    truth = {"ttft_ms": a.ttft * 1e3, "itl_ms": a.itl * 1e3}
    med = lambda rs, k: round(statistics.median(r[k] for r in rs), 4)  # noqa: E731
    summary: dict[str, Any] = {}
    for tool, rs in runs.items():
        if not rs:
            continue
        s = {"runs": len(rs), "ttft_p50_ms": med(rs, "ttft_p50_ms"), "itl_p50_ms": med(rs, "itl_p50_ms"),
             "ttft_runs_ms": [round(r["ttft_p50_ms"], 3) for r in rs],
             "itl_runs_ms": [round(r["itl_p50_ms"], 3) for r in rs], "itl_definition": rs[0]["itl_definition"]}
        lags = [r["send_lag_p50_ms"] for r in rs if r.get("send_lag_p50_ms") is not None]
        if lags:
            s["send_lag_p50_ms"] = round(statistics.median(lags), 4)
        s["ttft_error_ms"] = round(s["ttft_p50_ms"] - truth["ttft_ms"], 4)
        s["itl_error_ms"] = round(s["itl_p50_ms"] - truth["itl_ms"], 4)
        srv_rs = [r["server"] for r in rs if r["server"].get("requests")]
        if srv_rs:
            s["server"] = {k: round(statistics.median(x[k] for x in srv_rs), 4) for k in srv_rs[0] if k != "requests"}
        summary[tool] = s

    print(f"\ntruth (script): TTFT {truth['ttft_ms']:.2f} ms, ITL {truth['itl_ms']:.2f} ms; {a.concurrency} streams, "
          f"{a.output_tokens} tokens, {a.requests} requests x {a.repeats} repeats (medians of the repeats)")
    w = max([16, *(len(t) for t in summary)])
    head = (f"{'tool':{w}s} {'TTFT p50':>9s} {'error':>8s} {'ITL p50':>8s} {'error':>8s} | "
            f"{'server TTFT':>11s} {'server ITL':>10s} {'late p50':>8s} {'late last':>9s}")
    print(head)
    print("-" * len(head))
    for tool, s in summary.items():
        sv = s.get("server", {})
        print(f"{tool:{w}s} {s['ttft_p50_ms']:9.3f} {s['ttft_error_ms']:+8.3f} {s['itl_p50_ms']:8.3f} "
              f"{s['itl_error_ms']:+8.3f} | {sv.get('ttft_p50_ms', float('nan')):11.3f} "
              f"{sv.get('itl_p50_ms', float('nan')):10.3f} {sv.get('lateness_p50_ms', float('nan')):8.3f} "
              f"{sv.get('lateness_last_chunk_p50_ms', float('nan')):9.3f}")
    for tool, s in summary.items():
        if s.get("send_lag_p50_ms") is not None:
            print(f"{tool}: intended send -> HTTP client call p50 {s['send_lag_p50_ms']:.3f} ms (inside its TTFT)")
    for tool, why in skipped.items():
        print(f"{tool}: {why}")
    print("(ms; error = tool - script; server = the fake server's own send times for that tool's requests; "
          "late = chunk sent minus its absolute deadline, median over chunks and over last chunks)")

    result = {
        "benchmark": "bench_accuracy", "label": a.label, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "script": {"ttft_s": a.ttft, "itl_s": a.itl, "spin_s": a.spin}, "truth": truth,
        "load": {"concurrency": a.concurrency, "requests": a.requests, "input_tokens": a.input_tokens,
                 "output_tokens": a.output_tokens, "repeats": a.repeats},
        "tools": summary, "skipped": skipped, "runs": runs,
        "command": shlex.join(["python", "benchmarks/bench_accuracy.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
