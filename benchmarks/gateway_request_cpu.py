"""The gateway's CPU time a request: sequential streaming requests through gateways of one or more source trees.

    .venv/bin/python benchmarks/gateway_request_cpu.py                       # this tree alone, ~1 min
    git archive BASE src | tar -x -C /tmp/base && \
        .venv/bin/python benchmarks/gateway_request_cpu.py --compare-src /tmp/base/src    # before/after, one run

One request at a time (no queueing, no competition between requests), each ``--tokens`` tokens from
``benchmarks/sse_upstream.py`` with no scripted wait, through ``tailguard serve --upstream`` pinned to the last core
(the upstream and this client on the others). Rounds of ``--requests`` rotate over the gateways; a round's figure is
the gateway process's CPU time (user + system, from /proc) over its requests. Reported: the median of the rounds per
gateway, and the client's TTFT median. What the 256-stream benchmark (``gateway_overhead.py``) measures as latency
comes from this cost plus queueing; this one isolates the cost.

The cost of a token, apart from its request's: ``--itl`` spaces the upstream's tokens (so that each arrives in a read
of its own, as at a real engine's pace) and ``--concurrency`` streams run at once, e.g.
``--tokens 200 --itl 0.01 --concurrency 32 --requests 64`` (a round's CPU over its tokens, per-request costs spread
over 200 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import cpu_seconds, pin, ready, start_gateways, start_raw_upstream  # noqa: E402


async def one(session: aiohttp.ClientSession, url: str, tokens: int) -> float:
    """One streamed chat request; its TTFT at the client."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("no token came back")
    return first - t0


async def main(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tg-gwcpu-"))
    up, up_url = start_raw_upstream(tmp, 0.0, a.itl)
    gateways = start_gateways(tmp, up_url, a.compare_src)
    if len(os.sched_getaffinity(0)) >= 2:
        pin([proc for proc, _ in gateways.values()], [up])
    out: dict = {"config": vars(a), **{name: {"cpu_us_per_request": [], "cpu_us_per_token": [], "ttft": []}
                                       for name in gateways}}

    async def requests(session: aiohttp.ClientSession, url: str) -> list[float]:
        """``--requests`` requests, ``--concurrency`` at a time; their TTFTs."""
        todo = iter(range(a.requests))

        async def worker() -> list[float]:
            return [await one(session, url, a.tokens) for _ in todo]

        return [t for ts in await asyncio.gather(*(worker() for _ in range(a.concurrency))) for t in ts]

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await ready(session, up_url)
            for _, url in gateways.values():
                await ready(session, url)
                for _ in range(a.warmup):
                    await one(session, url, a.tokens)
            for rnd in range(a.rounds):
                order = list(gateways.items())
                order = order[rnd % len(order):] + order[:rnd % len(order)]
                for name, (proc, url) in order:
                    cpu0 = cpu_seconds(proc.pid)
                    ttfts = await requests(session, url)
                    cpu = (cpu_seconds(proc.pid) - cpu0) / a.requests * 1e6
                    out[name]["cpu_us_per_request"].append(cpu)
                    out[name]["cpu_us_per_token"].append(cpu / a.tokens)
                    out[name]["ttft"].extend(ttfts)
                    print(f"round {rnd + 1} {name}: {cpu:.0f} us CPU a request, {cpu / a.tokens:.1f} a token",
                          flush=True)
    finally:
        for p in [proc for proc, _ in gateways.values()] + [up]:
            p.terminate()
            p.wait(20)
    print("\n| gateway | CPU a request (median of rounds) | a token (request's share included) | rounds | "
          "client TTFT P50 |\n|---|---|---|---|---|")
    for name in gateways:
        r = out[name]
        r["cpu_us_per_request_median"] = statistics.median(r["cpu_us_per_request"])
        r["cpu_us_per_token_median"] = statistics.median(r["cpu_us_per_token"])
        r["ttft_p50_ms"] = statistics.median(r.pop("ttft")) * 1e3
        print(f"| {name} | {r['cpu_us_per_request_median']:.0f} us | {r['cpu_us_per_token_median']:.1f} us | "
              f"{' / '.join(f'{x:.0f}' for x in r['cpu_us_per_request'])} | {r['ttft_p50_ms']:.3f} ms |")
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--requests", type=int, default=500, help="requests a round (the CPU clock ticks at 10 ms)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--itl", type=float, default=0.0, help="seconds between the upstream's tokens")
    p.add_argument("--concurrency", type=int, default=1, help="streams at once")
    p.add_argument("--compare-src", action="append", metavar="SRC", help="also a gateway from this source folder")
    p.add_argument("--out", default="benchmarks/results/gateway_request_cpu.json")
    args = p.parse_args()
    result = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
