"""The engine behind `tailguard serve` against the engine alone: aggregate decode tokens/s at N streams, same run.

    .venv/bin/python benchmarks/serve_vs_engine.py                 # ~4 min; benchmarks/results/serve_vs_engine.json
    .venv/bin/python benchmarks/serve_vs_engine.py --streams 16 --repeats 3 --tokens 64

"Engine alone": N requests added at once to an in-process ``LLMEngine``, stepped until done. "Through serve": the same
N prompts as concurrent streaming chat requests over loopback HTTP to a ``tailguard serve`` subprocess (uvicorn,
uvloop; the engine in its background thread), read by an aiohttp client in this process. Both count output tokens
over the time from the first request sent to the last token received, with ``ignore_eos`` so every request makes
exactly ``--tokens`` tokens. Repeats alternate between the two so outside load hits both alike; medians are reported.
The target (issue 8) is through-serve >= 0.9x the engine alone at 16 streams.

Also reported, per output token: the CPU time of the server's event loop (its main thread), of its other threads
(the engine and its OpenMP workers), of this client, and of the engine alone. On a shared machine these hold still
where the rates swing with the neighbours' load. ``--baseline-src OTHER/src`` serves a second checkout beside this
one, in the same repeats (the order alternates), for a paired A/B of a server change.
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
from tailguard.engine.sequence import SamplingParams

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
        buf = b""
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            # Whatever arrived, split into SSE events: the client's own CPU competes with the engine for the same
            # cores, so it reads in bulk rather than line by line (every chunk is still parsed and checked).
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *events, buf = (buf + data).split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = json.loads(event[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
                    elif chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                        seen.append(now)
        arrivals.append(seen)
        return n

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(session, t) for t in texts))
        if any(c != tokens for c in counts):
            raise RuntimeError(f"expected {tokens} tokens per stream, the server reported {counts}")
        return sum(counts) / (time.perf_counter() - start), steady_rate(arrivals)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` (Linux /proc; empty elsewhere)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def sleeps(pid: int, skip: int | None = None) -> int:
    """Voluntary context switches of ``pid``'s threads (but ``skip``): an OpenMP thread that sleeps at a barrier
    instead of spinning makes one, so per step this tells the spinning engine from the throttled one."""
    total = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        if tid == skip:
            continue
        try:
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def cpu_split(pid: int, before: dict[int, float], after: dict[int, float], tokens: int) -> dict[str, float]:
    """Microseconds of CPU per output token: the server's event loop (uvicorn runs it on the main thread) and all
    its other threads (the engine thread and its OpenMP workers, the store, the samplers)."""
    loop = after.get(pid, 0.0) - before.get(pid, 0.0)
    rest = sum(v - before.get(t, 0.0) for t, v in after.items() if t != pid)
    return {"loop_us_per_token": 1e6 * loop / tokens, "other_threads_us_per_token": 1e6 * rest / tokens}


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


def start_server(args: argparse.Namespace, src: str | None) -> tuple[subprocess.Popen, str]:
    """``tailguard serve`` in a subprocess; ``src``: the ``src`` folder of another checkout to serve from instead."""
    port = free_port()
    exe = Path(sys.executable).with_name("tailguard")
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve())
    proc = subprocess.Popen([str(exe), "serve", "--model", "smollm2", "--weight-format", args.weight_format,
                             "--port", str(port), "--threads", str(args.threads), "--no-slo",
                             "--store", str(Path("/tmp") / f"tg-bench-{port}.db")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--baseline-src", default=None,
                        help="also serve from this src folder (another checkout) in the same repeats: a paired A/B")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "serve_vs_engine.json"))
    args = parser.parse_args()

    engine = LLMEngine(EngineArgs(model="smollm2", weight_format=args.weight_format, num_threads=args.threads))
    texts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.streams)]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    servers = {"serve": start_server(args, None)}
    if args.baseline_src:
        servers["baseline"] = start_server(args, args.baseline_src)
    runs: dict[str, list[float]] = {}
    cpu: dict[str, list[dict[str, float]]] = {}

    def add(key: str, value: float) -> None:
        runs.setdefault(key, []).append(value)

    ntok = args.streams * args.tokens
    try:
        for proc, url in servers.values():
            wait_ready(url, proc)
        engine_alone(engine, prompts[:2], 8)  # warm every path
        for _, url in servers.values():
            asyncio.run(through_serve(url, texts[:2], 8))
        order = list(servers)
        for rep in range(args.repeats):
            me = os.getpid()
            before, slept = thread_cpu(me), sleeps(me)
            e2e, steady = engine_alone(engine, prompts, args.tokens)
            after, slept = thread_cpu(me), sleeps(me) - slept
            add("engine", e2e)
            add("engine_steady", steady)
            cpu.setdefault("engine", []).append(
                {"engine_us_per_token": 1e6 * sum(v - before.get(t, 0.0) for t, v in after.items()) / ntok,
                 "sleeps_per_step": slept / args.tokens})
            time.sleep(0.5)
            line = f"repeat {rep + 1}/{args.repeats}: engine alone {e2e:.1f} tok/s (steady {steady:.1f})"
            for name in order[rep % len(order):] + order[:rep % len(order)]:  # alternate which server goes first
                proc, url = servers[name]
                before, slept = thread_cpu(proc.pid), sleeps(proc.pid, skip=proc.pid)
                client0 = os.times()
                e2e, steady = asyncio.run(through_serve(url, texts, args.tokens))
                client1 = os.times()
                split = cpu_split(proc.pid, before, thread_cpu(proc.pid), ntok)
                split["sleeps_per_step"] = (sleeps(proc.pid, skip=proc.pid) - slept) / args.tokens
                split["client_us_per_token"] = 1e6 * (client1.user + client1.system - client0.user
                                                      - client0.system) / ntok
                cpu.setdefault(name, []).append(split)
                add(name, e2e)
                add(f"{name}_steady", steady)
                time.sleep(0.5)
                line += f", {name} {e2e:.1f} tok/s (steady {steady:.1f}, loop {split['loop_us_per_token']:.0f} us/tok)"
            print(line, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in runs.items()}
    cpu_med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in cpu.items()}
    ratios = {name: {"ratio": med[name] / med["engine"], "steady_ratio": med[f"{name}_steady"] / med["engine_steady"]}
              for name in servers}
    # The same ratios repeat by repeat (each server against the engine alone of its own repeat): less exposed to a
    # load swing between repeats than the ratio of medians.
    paired = {name: {"ratio": statistics.median(s / e for s, e in zip(runs[name], runs["engine"])),
                     "steady_ratio": statistics.median(s / e for s, e in zip(runs[f"{name}_steady"],
                                                                              runs["engine_steady"]))}
              for name in servers}
    print("\n| server | rate | engine alone (tok/s) | through tailguard serve (tok/s) | ratio of medians | "
          "median of paired ratios |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in servers:
        print(f"| {name} | end to end | {med['engine']:.1f} | {med[name]:.1f} | {ratios[name]['ratio']:.2f}x | "
              f"{paired[name]['ratio']:.2f}x |")
        print(f"| {name} | steady decode | {med['engine_steady']:.1f} | {med[f'{name}_steady']:.1f} | "
              f"{ratios[name]['steady_ratio']:.2f}x | {paired[name]['steady_ratio']:.2f}x |")
    print("\nCPU per output token (us) and sleeps per step of the engine's threads, medians: " + "; ".join(
        f"{name}: " + ", ".join(f"{k.removesuffix('_us_per_token')} {v:.0f}" for k, v in c.items())
        for name, c in cpu_med.items()))
    result = {"streams": args.streams, "tokens": args.tokens, "threads": args.threads,
              "weight_format": engine.weight_format, "baseline_src": args.baseline_src, "runs": runs, "median": med,
              "ratio": ratios["serve"]["ratio"], "steady_ratio": ratios["serve"]["steady_ratio"], "ratios": ratios,
              "paired_ratios": paired, "cpu_us_per_token": cpu_med, "cpu_runs": cpu,
              "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
