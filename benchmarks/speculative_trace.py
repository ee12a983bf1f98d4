#!/usr/bin/env python
"""Speculative decoding's effect on P99 E2E under the Azure conversation trace: a paired A/B in one server.

Comparing two server runs one after the other measures the machine as much as the technique here (other jobs on the
2 vCPUs moved the same configuration's P99 by 5x between runs). So one ``tailguard serve --speculative ngram``
serves the whole replay, and each request is assigned at random (seeded, 50/50) to speculate or to opt out
(``"speculative": false``): both arms share the same moments, load and noise (formatted prompts alternate between
the arms prompt by prompt, so both get the same mix of tasks). Arrival times and lengths come from
the trace (time-scaled, lengths scaled); the prompts are either the trace's synthetic text (``--prompts trace``,
free chat: n-gram lookup finds little) or formatted tasks ("repeat and fix", JSON extraction, code edits: the
seed's customer-service case) drawn at random (``--prompts formatted``). Client-side TTFT and E2E per request;
P50/P95/P99 per arm with bootstrap 95% intervals.

The arms are not independent: a speculating request makes the steps it shares longer for everybody, and the batch
stops speculating above ``--speculative-max-running`` sequences. What the table shows is what a request gains or
loses by speculating, inside a server that lets it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speculative_trace.py --prompts formatted   # ~5 min (60 trace seconds at x0.25)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import free_port, wait_ready  # noqa: E402
from speculative import FORMATTED, PROMPTS  # noqa: E402

from tailguard.bench.workloads import TraceWorkload  # noqa: E402
from tailguard.engine.model_store import resolve_model_path  # noqa: E402
from tailguard.engine.tokenizer import GGUFTokenizer  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def bootstrap_ci(xs: list[float], q: float, rng: random.Random, n: int = 2000) -> tuple[float, float]:
    if len(xs) < 2:
        return (float("nan"), float("nan"))
    stats = sorted(pct([rng.choice(xs) for _ in xs], q) for _ in range(n))
    return stats[int(0.025 * n)], stats[int(0.975 * n)]


async def one(client: httpx.AsyncClient, url: str, body: dict, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent = time.perf_counter()
    first = None
    tokens = 0
    status = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
    done = time.perf_counter()
    return {"speculative": body["speculative"], "status": status, "ttft": (first or done) - sent, "e2e": done - sent,
            "chunks": tokens, "request_id": r.headers.get("x-request-id"),
            "server_timing": r.headers.get("server-timing")}


async def replay(url: str, a: argparse.Namespace) -> list[dict]:
    tok = GGUFTokenizer(resolve_model_path("smollm2"))
    wl = TraceWorkload(tok, source=a.trace, speedup=a.speedup, length_scale=a.length_scale, duration=a.duration,
                       max_input_tokens=a.max_input, max_output_tokens=a.max_output, seed=a.seed)
    rng = random.Random(a.seed)
    formatted = [t for c in FORMATTED for t in PROMPTS[c]]
    seen: dict[str, int] = {}
    bodies = []
    for i, offset in enumerate(wl.offsets()):
        spec = wl.spec(i)
        text = rng.choice(formatted) if a.prompts == "formatted" else spec.text()
        # Formatted prompts alternate between the arms, so both get the same mix of tasks (answers of 20 to 96
        # tokens: a random split of a few dozen requests would compare task mixes, not speculation).
        n = seen[text] = seen.get(text, rng.randrange(2)) + 1
        speculative = n % 2 == 0 if a.prompts == "formatted" else rng.random() < 0.5
        bodies.append((offset, {"model": "smollm2", "messages": [{"role": "user", "content": text}],
                                "max_tokens": spec.max_tokens if a.prompts == "trace" else a.formatted_tokens,
                                "temperature": 0, "stream": True, "speculative": speculative}))
    print(f"{len(bodies)} requests over {wl.offsets()[-1]:.0f} s", flush=True)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(client, url, b, off, t0) for off, b in bodies))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", choices=["trace", "formatted"], default="formatted")
    p.add_argument("--trace", default="conv")
    p.add_argument("--speedup", type=float, default=0.25)
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--duration", type=float, default=60, help="trace seconds replayed (/ speedup = wall seconds)")
    p.add_argument("--max-input", type=int, default=1536)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--formatted-tokens", type=int, default=96, help="max_tokens of the formatted tasks")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    out = Path(a.out or Path(__file__).parent / "results" / f"speculative_trace_{a.prompts}.json")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="tg-spec-trace-"))
    srv = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--port", str(port), "--no-access-log",
                            "--log-level", "warning", "--no-slo", "--store", str(tmp / "s.sqlite3"), "--speculative",
                            "ngram", "--threads", str(a.threads)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    try:
        wait_ready(srv, url)
        load0 = os.getloadavg()[0]
        results = asyncio.run(replay(url, a))
        load1 = os.getloadavg()[0]
    finally:
        srv.terminate()
        srv.wait(60)
    rng = random.Random(7)
    arms = {}
    for name, flag in (("off", False), ("on", True)):
        rs = [r for r in results if r["speculative"] is flag and r["status"] == 200]
        arms[name] = {"requests": len(rs), "failed": sum(r["speculative"] is flag and r["status"] != 200
                                                         for r in results)}
        for metric in ("ttft", "e2e"):
            xs = [r[metric] for r in rs]
            for q in (50, 95, 99):
                arms[name][f"{metric}_p{q}"] = pct(xs, q)
                arms[name][f"{metric}_p{q}_ci"] = bootstrap_ci(xs, q, rng)
        arms[name]["mean_chunks"] = statistics.mean(r["chunks"] for r in rs) if rs else 0
    result = {"config": vars(a), "load_average": [round(load0, 2), round(load1, 2)], "arms": arms,
              "requests": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{a.prompts} prompts, conv trace x{a.speedup}, load average {load0:.1f} -> {load1:.1f}")
    print("| arm | requests | TTFT P50 | TTFT P99 | E2E P50 | E2E P95 | E2E P99 (95% CI) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, m in arms.items():
        lo, hi = m["e2e_p99_ci"]
        print(f"| {name} | {m['requests']} | {m['ttft_p50']:.2f} s | {m['ttft_p99']:.2f} s | {m['e2e_p50']:.2f} s | "
              f"{m['e2e_p95']:.2f} s | {m['e2e_p99']:.2f} s ({lo:.2f}-{hi:.2f}) |")
    off, on = arms["off"]["e2e_p99"], arms["on"]["e2e_p99"]
    print(f"P99 E2E with speculation vs without: {on / off - 1:+.0%}; P50 "
          f"{arms['on']['e2e_p50'] / arms['off']['e2e_p50'] - 1:+.0%}; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
