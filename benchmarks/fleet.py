"""Many gateways, one view: goodput of 2 gateways x 2 replicas against 1 gateway x 1 replica at the same SLO, and
the accuracy of a tenant's rate limit held by 2 gateways through Redis (issue 13's Fleet targets: >= 1.8x, within 5%).

    python benchmarks/fleet.py                 # prints a table; writes benchmarks/results/fleet.json

The replicas are ``tailguard serve --model fake`` processes with fixed concurrency slots (``--slots``) and scripted
timings: they stand in for GPU servers, so that what is measured is whether the gateways add capacity as replicas do
(and keep the lanes' budget fleet-wide) rather than a model's speed. Every process runs on this machine (the example
``examples/fleet.py`` starts them).

Goodput at the SLO: Poisson arrivals, spread round-robin over the gateways, at a ladder of rates (multiples of one
replica's nominal capacity ``slots / service time``); a step passes when every request succeeds and the P95 of E2E is
within ``--slo-e2e``; the goodput of a setup is the rate of SLO-meeting answers at its highest passing step.

Rate-limit accuracy: a tenant limited to ``--tenant-rate`` requests/s (bucket depth ``--burst-s``) sends as fast as
two clients per gateway can to both gateways; the answers let through are compared with what the limit allows over
the run (a full bucket, then the sustained rate), with and without Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
# The fleet's process helpers live in the example (loaded by path: this file has the same name).
_spec = importlib.util.spec_from_file_location("fleet_example", HERE.parent / "examples" / "fleet.py")
assert _spec is not None and _spec.loader is not None
_example = sys.modules["fleet_example"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
fleet = _example.fleet

TENANTS = {"load": {"lane": "standard"}}  # goodput: a tenant without limits (the keys file is on, as in production)


async def _one(session: aiohttp.ClientSession, url: str, key: str, max_tokens: int) -> tuple[int, float]:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hello there " * 8}],
            "max_tokens": max_tokens, "stream": False}
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as r:
            await r.read()
            return r.status, time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError):
        return 0, time.perf_counter() - t0


async def _step(urls: list[str], key: str, rate: float, duration: float, max_tokens: int, seed: int) -> dict:
    """Poisson arrivals at ``rate`` for ``duration`` s, round-robin over ``urls``."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(int(rate * duration * 3) + 100)]  # unit-rate, scaled below
    tasks = []
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        t, i = 0.0, 0
        while t < duration:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, urls[i % len(urls)], key, max_tokens)))
            i += 1
            t += gaps[i - 1] / rate
        results = await asyncio.gather(*tasks)
    return {"rate": rate, "sent": len(results), "results": results}


def _judge(step: dict, slo_e2e: float, duration: float) -> dict:
    codes = [c for c, _ in step["results"]]
    e2e = np.array([s for c, s in step["results"] if c == 200])
    ok = codes.count(200)
    p95 = float(np.percentile(e2e, 95)) if len(e2e) else None
    met = int((e2e <= slo_e2e).sum()) if len(e2e) else 0
    return {"rate": round(step["rate"], 2), "sent": step["sent"], "ok": ok, "failed": step["sent"] - ok,
            "p50_e2e": float(np.percentile(e2e, 50)) if len(e2e) else None, "p95_e2e": p95,
            "goodput": met / duration, "passed": ok == step["sent"] and p95 is not None and p95 <= slo_e2e}


def goodput(n: int, a: argparse.Namespace, ladder: list[float], c1: float) -> dict:
    """The ladder on an n-gateway x n-replica fleet (sharing Redis)."""
    with fleet(n_gateways=n, n_replicas=n, replica_slots=a.slots, ttft=a.ttft, itl=a.itl, postgres=False,
               prometheus=False, tenants=TENANTS) as fl:
        steps, best = [], None
        for mult in ladder:
            # One arrival sequence for every step and setup (scaled by the rate): the steps differ by rate only.
            raw = asyncio.run(_step(fl.gateways, fl.keys["load"], mult * c1, a.step_s, a.output_tokens, seed=0))
            j = _judge(raw, a.slo_e2e, a.step_s)
            steps.append(j)
            print(f"  {n}x{n}  {j['rate']:6.1f} req/s offered: ok {j['ok']}/{j['sent']}, P95 E2E "
                  f"{(j['p95_e2e'] or float('nan')) * 1000:6.0f} ms -> {'pass' if j['passed'] else 'FAIL'}",
                  flush=True)
            if not j["passed"]:
                break
            best = j
    return {"gateways": n, "replicas": n, "steps": steps, "best": best}


async def _hammer(urls: list[str], key: str, run_s: float, workers: int) -> list[tuple[float, int, str]]:
    out: list[tuple[float, int, str]] = []
    stop = time.monotonic() + run_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def worker(url: str) -> None:
            while time.monotonic() < stop:
                t = time.monotonic()
                code, _ = await _one(session, url, key, 1)
                out.append((t, code, url))
                await asyncio.sleep(0.005)  # a tight loop of 429s would only measure this machine's CPU
        await asyncio.gather(*(worker(u) for u in urls for _ in range(workers)))
    return out


def rate_limit(a: argparse.Namespace, shared: bool) -> dict:
    tenants = {"acme": {"lane": "standard", "requests_per_s": a.tenant_rate, "burst_s": a.burst_s}}
    with fleet(n_gateways=2, n_replicas=2, replica_slots=a.slots, ttft=0.01, itl=0.005, redis=shared,
               postgres=False, prometheus=False, tenants=tenants) as fl:
        got = asyncio.run(_hammer(fl.gateways, fl.keys["acme"], a.limit_s, workers=2))
    ok = [(t, u) for t, c, u in got if c == 200]
    t0 = min(t for t, _, _ in got)
    t1 = max(t for t, _ in ok)
    allowed = a.tenant_rate * a.burst_s + a.tenant_rate * (t1 - t0)
    return {"shared": shared, "sent": len(got), "served": len(ok),
            "refused_429": sum(1 for _, c, _ in got if c == 429),
            "other": sum(1 for _, c, _ in got if c not in (200, 429)),
            "per_gateway": [sum(1 for _, u in ok if u == g) for g in fl.gateways],
            "allowed": round(allowed, 1), "error_pct": round(100 * (len(ok) - allowed) / allowed, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=4, help="concurrent sequences per fake replica")
    p.add_argument("--ttft", type=float, default=0.2)
    p.add_argument("--itl", type=float, default=0.02)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--slo-e2e", type=float, default=0.8, help="the SLO: P95 of E2E within this many seconds")
    p.add_argument("--step-s", type=float, default=8.0, help="seconds per ladder step")
    p.add_argument("--tenant-rate", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=1.0)
    p.add_argument("--limit-s", type=float, default=6.0, help="seconds of the rate-limit run")
    p.add_argument("--out", default=str(HERE / "results" / "fleet.json"))
    a = p.parse_args()
    service = a.ttft + (a.output_tokens - 1) * a.itl
    c1 = a.slots / service  # one replica's nominal capacity, requests/s
    ladder = [0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4, 1.6, 1.7, 1.8, 1.9, 2.0, 2.2]
    print(f"one replica: {a.slots} slots x {service:.2f} s per request = {c1:.1f} requests/s nominal; SLO: P95 E2E "
          f"<= {a.slo_e2e:g} s and no failures", flush=True)
    one = goodput(1, a, ladder, c1)
    two = goodput(2, a, ladder, c1)
    g1 = one["best"]["goodput"] if one["best"] else 0.0
    g2 = two["best"]["goodput"] if two["best"] else 0.0
    print("rate limit across 2 gateways ...", flush=True)
    limits = [rate_limit(a, shared=True), rate_limit(a, shared=False)]
    ratio = g2 / g1 if g1 else float("nan")
    rate_ratio = two["best"]["rate"] / one["best"]["rate"] if one["best"] and two["best"] else float("nan")
    rows = [
        ("1 gateway x 1 replica: goodput at the SLO", f"{g1:.1f} req/s",
         f"highest passing step {one['best']['rate'] if one['best'] else '-'} req/s"),
        ("2 gateways x 2 replicas: goodput at the SLO", f"{g2:.1f} req/s",
         f"highest passing step {two['best']['rate'] if two['best'] else '-'} req/s"),
        ("goodput ratio (target >= 1.8x)", f"{ratio:.2f}x", "PASS" if ratio >= 1.8 else "below target"),
        ("ratio of the highest passing offered rates", f"{rate_ratio:.2f}x", "the ladder's resolution: ~0.1 x c1"),
    ]
    for lim in limits:
        what = "Redis shared" if lim["shared"] else "no Redis (each gateway alone)"
        rows.append((f"rate limit, 2 gateways, {what}", f"{lim['served']} served / {lim['allowed']} allowed",
                     f"{lim['error_pct']:+.1f}% (per gateway {lim['per_gateway']}, {lim['refused_429']} x 429)"))
    width = max(len(r[0]) for r in rows)
    print()
    for name, val, note in rows:
        print(f"{name:<{width}}  {val:>28}  {note}")
    result = {
        "benchmark": "fleet", "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "2 shared cores; other agents were running: absolute figures are pessimistic"},
        "config": vars(a), "nominal_replica_rps": c1, "one": one, "two": two, "goodput_ratio": ratio,
        "passing_rate_ratio": rate_ratio,
        "rate_limit": limits,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=_jsonable))
    print(f"\nwritten: {out}")
    return 0


def _jsonable(x: Any) -> Any:
    return float(x) if isinstance(x, np.floating) else str(x)


if __name__ == "__main__":
    sys.exit(main())
