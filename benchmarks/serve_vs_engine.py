"""The engine behind `tailguard serve` against the engine alone: aggregate decode tokens/s at N streams, same run.

    .venv/bin/python benchmarks/serve_vs_engine.py                 # ~4 min; benchmarks/results/serve_vs_engine.json
    .venv/bin/python benchmarks/serve_vs_engine.py --streams 16 --repeats 3 --tokens 64

"Engine alone": N requests added at once to an in-process ``LLMEngine``, stepped until done. "Through serve": the same
N prompts as concurrent streaming chat requests over loopback HTTP to a ``tailguard serve`` subprocess (uvicorn,
uvloop; the engine in its background thread), read by an aiohttp client in this process. Both count output tokens
over the time from the first request sent to the last token received, with ``ignore_eos`` so every request makes
exactly ``--tokens`` tokens. Repeats alternate between the two so outside load hits both alike; medians are reported.
The target (issue 8) is through-serve >= 0.9x the engine alone at 16 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.request import SamplingParams

PROMPTS = [
    "Write a story about a lighthouse keeper.", "请写一段关于秋天的文字。", "Explain how a hash map works.",
    "介绍一下长城的历史。", "Describe a walk through a forest in spring.", "什么是量子计算？请详细解释。",
    "List ten ideas for a birthday party.", "写一封给朋友的信，讲讲你最近的生活。",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_rate(times: list[list[float]]) -> float:
    """Tokens per second while every stream is decoding: from the last stream's first token to the first stream's
    last token (prefill and the ragged start and end left out, where arrival order, not the server, sets the pace)."""
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    n = sum(sum(1 for x in t if start < x <= end) for t in times)
    return n / (end - start) if end > start else float("nan")


def engine_alone(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
    times: dict[str, list[float]] = {r: [] for r in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                times[ev.request_id].append(ev.time)
    total = sum(len(t) for t in times.values())
    return total / (time.perf_counter() - start), steady_rate(list(times.values()))


async def through_serve(url: str, texts: list[str], tokens: int) -> tuple[float, float]:
    arrivals: list[list[float]] = []

    async def one(session: aiohttp.ClientSession, text: str) -> int:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        n = 0
        seen: list[float] = []
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        seen.append(time.perf_counter())
        arrivals.append(seen)
        return n

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, t) for t in texts))
        return sum(counts) / (time.perf_counter() - start), steady_rate(arrivals)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("tailguard serve exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("tailguard serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "serve_vs_engine.json"))
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model="smollm2", weight_format=args.weight_format, num_threads=args.threads))
    texts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.streams)]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("tailguard")
    proc = subprocess.Popen([str(exe), "serve", "--model", "smollm2", "--weight-format", args.weight_format,
                             "--port", str(port), "--threads", str(args.threads), "--no-slo",
                             "--store", str(Path("/tmp") / f"tg-bench-{port}.db")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[float]] = {"engine": [], "serve": [], "engine_steady": [], "serve_steady": []}
    try:
        wait_ready(url, proc)
        engine_alone(engine, prompts[:2], 8)  # warm both
        asyncio.run(through_serve(url, texts[:2], 8))
        for rep in range(args.repeats):
            e2e, steady = engine_alone(engine, prompts, args.tokens)
            runs["engine"].append(e2e)
            runs["engine_steady"].append(steady)
            time.sleep(0.5)
            e2e, steady = asyncio.run(through_serve(url, texts, args.tokens))
            runs["serve"].append(e2e)
            runs["serve_steady"].append(steady)
            time.sleep(0.5)
            print(f"repeat {rep + 1}/{args.repeats}: engine alone {runs['engine'][-1]:.1f} tok/s "
                  f"(steady {runs['engine_steady'][-1]:.1f}), through serve {runs['serve'][-1]:.1f} tok/s "
                  f"(steady {runs['serve_steady'][-1]:.1f})", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["serve"] / med["engine"]
    steady_ratio = med["serve_steady"] / med["engine_steady"]
    print("\n| streams | rate | engine alone (tok/s) | through tailguard serve (tok/s) | ratio |")
    print("| ---: | --- | ---: | ---: | ---: |")
    print(f"| {args.streams} | end to end | {med['engine']:.1f} | {med['serve']:.1f} | {ratio:.2f}x |")
    print(f"| {args.streams} | steady decode | {med['engine_steady']:.1f} | {med['serve_steady']:.1f} | "
          f"{steady_ratio:.2f}x |")
    result = {"streams": args.streams, "tokens": args.tokens, "threads": args.threads,
              "weight_format": engine.weight_format, "runs": runs, "median": med, "ratio": ratio, "steady_ratio": steady_ratio,
              "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
