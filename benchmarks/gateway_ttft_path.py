"""Where a request's time goes inside the gateway on its way to the first token, by stamps taken in the gateway.

    .venv/bin/python benchmarks/gateway_ttft_path.py                                   # this tree, ~2 min
    git archive BASE src | tar -x -C /tmp/base && \\
        .venv/bin/python benchmarks/gateway_ttft_path.py --compare-src /tmp/base/src     # before/after, one run

``gateway_overhead.py`` sees the gateway from the client, through two more hops and the client's own scheduling, so
a tenth of a millisecond inside the gateway is lost in its noise. Here the gateway (``gateway_path_probe.py``:
``tailguard serve`` with wrappers, no change to tailguard) stamps each request where it happens:

- ``uvicorn``: the client's bytes read -> the request's task created (uvicorn's parse);
- ``wait``: task created -> task running (the event loop's queue);
- ``request``: task running -> the request written to the replica (tailguard's handling before it leaves);
- ``first token``: the replica's first token read -> its chunk written to the client;
- ``in gateway``: the sum of the four, the gateway's own share of the TTFT.

Two phases per gateway, each in a fresh process: *idle*, ``--requests`` sequential one-token requests to an upstream
(``sse_upstream.py``) that answers at once, where the operating system places the processes (a gateway pinned alone
to a core that idles between requests wakes it cold at each one: +100-200 us a request, all of it noise); and
*load*, the gateway pinned to the last core (the upstream and this client on the others), Poisson arrivals keeping ``--streams`` streams of 20 tokens (50 ms TTFT, 200 ms gaps) in flight for
``--seconds`` after a 6 s warm-up, as ``gateway_overhead.py --upstream raw --arrivals poisson`` runs them. Rounds
rotate over the gateways. Printed: each segment's P50/P90/P99 over the rounds' requests together; written: the same
and each round's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from gateway_overhead import pin, ready, round_, start_gateway, start_raw_upstream  # noqa: E402
from gateway_request_cpu import one  # noqa: E402

PROBE = Path(__file__).with_name("gateway_path_probe.py")
SEGMENTS = {  # name: (from, to) stamps; "in gateway" is the sum of the four
    "uvicorn": ("read", "task"),
    "wait": ("task", "run"),
    "request": ("run", "up_written"),
    "first token": ("up_token", "token_written"),
}


def segments(path: Path, since_ns: int) -> dict[str, list[float]]:
    """Each segment's microseconds for the requests read after ``since_ns`` that reached their first token."""
    data = json.loads(path.read_text())
    idx = {k: i for i, k in enumerate(data["stamps"])}
    out: dict[str, list[float]] = {name: [] for name in [*SEGMENTS, "in gateway"]}
    for row in data["requests"]:
        if row[idx["read"]] < since_ns or not all(row):
            continue
        total = 0.0
        for name, (a, b) in SEGMENTS.items():
            us = (row[idx[b]] - row[idx[a]]) / 1e3
            out[name].append(us)
            total += us
        out["in gateway"].append(total)
    return out


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))] if v else float("nan")


async def phase(tmp: Path, src: str | None, load: bool, a: argparse.Namespace, tag: str) -> dict[str, list[float]]:
    """One gateway process, one phase; its requests' segments."""
    up, up_url = start_raw_upstream(tmp, 0.05 if load else 0.0, 0.2 if load else 0.0)
    out = tmp / f"{tag}.json"
    gw, url = start_gateway(tmp, up_url, src, launcher=[str(PROBE), str(out)])
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await ready(session, up_url)
            await ready(session, url)
            if load and len(os.sched_getaffinity(0)) >= 2:
                pin([gw], [up])
            if load:
                since = time.perf_counter_ns() + int(6e9)  # requests of the warm-up are not counted
                await round_(session, url, a.streams, 20, seconds=a.seconds + 6, warmup=6,
                             poisson_rate=a.streams / (0.05 + 19 * 0.2))
            else:
                for _ in range(200):
                    await one(session, url, 1)
                since = time.perf_counter_ns()
                for _ in range(a.requests):
                    await one(session, url, 1)
    finally:
        gw.send_signal(signal.SIGINT)
        gw.wait(timeout=60)
        up.kill()
        up.wait()
    return segments(out, since)


async def main(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tg-ttftpath-"))
    trees = {"gateway": None, **{f"gateway_compare{i + 1}": s for i, s in enumerate(a.compare_src or [])}}
    res: dict = {"config": vars(a), "rounds": []}
    pooled: dict = {name: {"idle": {}, "load": {}} for name in trees}
    for rnd in range(a.rounds):
        order = list(trees.items())
        order = order[rnd % len(order):] + order[:rnd % len(order)]
        for name, src in order:
            for ph in ("idle", "load"):
                segs = await phase(tmp, src, ph == "load", a, f"{name}_{ph}_{rnd}")
                res["rounds"].append({"round": rnd + 1, "gateway": name, "phase": ph,
                                      **{k: {"p50": pct(v, .5), "p99": pct(v, .99), "n": len(v)}
                                         for k, v in segs.items()}})
                for k, v in segs.items():
                    pooled[name][ph].setdefault(k, []).extend(v)
                print(f"round {rnd + 1} {name} {ph}: in gateway P50 {pct(segs['in gateway'], .5):.0f} us, "
                      f"P99 {pct(segs['in gateway'], .99):.0f} us ({len(segs['in gateway'])} requests)", flush=True)
    res["pooled"] = {}
    print(f"\n{'gateway':18s} {'phase':5s} {'segment':12s} {'P50 us':>8s} {'P90 us':>8s} {'P99 us':>8s}")
    for name, phases in pooled.items():
        for ph, segs in phases.items():
            for k, v in segs.items():
                row = {"p50": pct(v, .5), "p90": pct(v, .9), "p99": pct(v, .99), "n": len(v)}
                res["pooled"].setdefault(name, {}).setdefault(ph, {})[k] = row
                print(f"{name:18s} {ph:5s} {k:12s} {row['p50']:8.0f} {row['p90']:8.0f} {row['p99']:8.0f}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare-src", action="append", help="another source tree's src folder (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests of the idle phase")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=25.0, help="timed seconds of the load phase")
    ap.add_argument("--out", default=None, help="results JSON")
    asyncio.run(main(ap.parse_args()))
