"""The gateway under 3x overload: zero 5xx, admitted traffic inside its SLO, memory flat.

    .venv/bin/python benchmarks/gateway_overload.py                      # 10 min; benchmarks/results/gateway_overload.json
    .venv/bin/python benchmarks/gateway_overload.py --minutes 3 --overload 3

A ``tailguard serve --model fake`` replica (scripted TTFT and gaps) behind a gateway whose capacity is
``--capacity`` concurrent streams; Poisson arrivals at ``--overload`` times the rate that capacity sustains
(capacity / one request's time). The gateway must refuse the excess at once (429 + Retry-After) and serve what it
admits within the SLO (TTFT P99 <= ``--ttft-slo``). Every 10 s the gateway's RSS is sampled; reported: status counts,
admitted TTFT P50/P99, and RSS at the start and end of the second half of the run (after warm-up), with its slope.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import pct, ready, start  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(session: aiohttp.ClientSession, url: str, tokens: int, out: list) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    first = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            status = resp.status
            retry = resp.headers.get("Retry-After")
            async for line in resp.content:
                if first is None and line.startswith(b"data: {") and b'"content"' in line:
                    first = time.perf_counter()
        out.append((status, None if first is None else first - t0, time.perf_counter() - t0, retry))
    except aiohttp.ClientError as exc:
        out.append((599, None, time.perf_counter() - t0, str(exc)[:80]))


async def main(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tg-overload-"))
    fake = {"ttft": a.ttft, "itl": a.itl, "max_num_seqs": 4096}
    up, up_url = start(["--model", "fake", "--max-queue", "4096"], tmp, {"fake": fake, "slo": {"enabled": False}})
    async with aiohttp.ClientSession() as s0:
        await ready(s0, up_url)
    gw, gw_url = start(["--upstream", up_url], tmp,
                       {"slo": {"enabled": False}, "capacity": {"max_concurrent": a.capacity},
                        "lanes": {"standard": {"max_queue": a.capacity, "max_queue_wait_s": a.queue_wait}}})
    service = a.ttft + a.itl * (a.tokens - 1)
    rate = a.overload * a.capacity / service
    results: list = []
    rss: list[tuple[float, float]] = []
    rng = random.Random(1)
    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
            await ready(session, gw_url)
            t0 = time.perf_counter()
            end = t0 + a.minutes * 60
            tasks: set[asyncio.Task] = set()
            next_at, next_sample, sent = t0, t0, 0
            while time.perf_counter() < end:
                now = time.perf_counter()
                if now >= next_sample:
                    rss.append((now - t0, rss_mib(gw.pid)))
                    done = len(results)
                    print(f"t={now - t0:5.0f}s sent={sent} done={done} rss={rss[-1][1]:.0f} MiB", flush=True)
                    next_sample += 10
                if now >= next_at:
                    task = asyncio.create_task(one(session, gw_url, a.tokens, results))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    sent += 1
                    next_at += rng.expovariate(rate)
                    continue
                await asyncio.sleep(min(next_at, next_sample) - now)
            await asyncio.gather(*tasks)
            rss.append((time.perf_counter() - t0, rss_mib(gw.pid)))
    finally:
        for p in (gw, up):
            p.terminate()
            p.wait(20)
    codes: dict[str, int] = {}
    for st, *_ in results:
        codes[str(st)] = codes.get(str(st), 0) + 1
    ok_ttft = [r[1] for r in results if r[0] == 200 and r[1] is not None]
    half = [v for t, v in rss if t >= a.minutes * 30]
    slope = 0.0
    if len(half) >= 2:
        ts = [t for t, _ in rss if t >= a.minutes * 30]
        mt, mv = statistics.fmean(ts), statistics.fmean(half)
        slope = sum((t - mt) * (v - mv) for t, v in zip(ts, half, strict=True)) / max(
            1e-9, sum((t - mt) ** 2 for t in ts)) * 60
    retry_after = [int(r[3]) for r in results if r[0] == 429 and r[3] and str(r[3]).isdigit()]
    return {"config": vars(a), "offered_rate": rate, "codes": codes, "requests": len(results),
            "five_xx": sum(v for k, v in codes.items() if k.startswith("5")),
            "admitted_ttft_p50": pct(ok_ttft, 50), "admitted_ttft_p99": pct(ok_ttft, 99),
            "retry_after_median": statistics.median(retry_after) if retry_after else None,
            "rss_mib": rss, "rss_second_half_first": half[0] if half else None,
            "rss_second_half_last": half[-1] if half else None, "rss_slope_mib_per_min": slope}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--overload", type=float, default=3.0)
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--queue-wait", type=float, default=1.0)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--out", default="benchmarks/results/gateway_overload.json")
    args = p.parse_args()
    res = asyncio.run(main(args))
    print(f"\noffered {res['offered_rate']:.1f} req/s ({args.overload:g}x capacity) for {args.minutes:g} min: "
          f"{res['requests']} requests, status {res['codes']}, 5xx {res['five_xx']}")
    print(f"admitted TTFT P50 {res['admitted_ttft_p50'] * 1e3:.0f} ms, P99 {res['admitted_ttft_p99'] * 1e3:.0f} ms "
          f"(SLO {args.ttft_slo * 1e3:.0f} ms); Retry-After median {res['retry_after_median']} s")
    print(f"gateway RSS second half: {res['rss_second_half_first']:.0f} -> {res['rss_second_half_last']:.0f} MiB "
          f"(slope {res['rss_slope_mib_per_min']:+.2f} MiB/min)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
