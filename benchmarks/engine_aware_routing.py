"""Today's routing against engine-aware routing, same run, same schedule, on two real replicas whose state differs.

    .venv/bin/python benchmarks/engine_aware_routing.py              # ~10 minutes: 2 scenarios x 2 rounds x 2 gateways
    .venv/bin/python benchmarks/engine_aware_routing.py --quick      # a smoke run (~2 minutes)

Two ``tailguard serve --model fake`` replicas (scripted engines: a 50 ms prefill, 20 ms between tokens plus 5 ms per
other running sequence, ``max_num_seqs`` slots, more wait in the engine's queue; each exports its running and waiting
requests on /metrics) and two gateways in front of both, identical but for ``routing.load``:

- *tokens* (today's routing, the default): the power of two choices on the gateway's own outstanding tokens there,
  plus 256 tokens per request the replica's /metrics says is waiting;
- *engine*: ``routing.load: engine``, the replica's load as its engine reports it (waiting + running / slots + KV
  pressure), read every 0.5 s and kept current from the gateway's own traffic in between.

Both gateways read every replica's /metrics every 0.5 s (the same code: only the weighing differs). Scenarios:

- ``neighbour``: both replicas run 4 sequences at a time (``max_concurrent: 4`` each, as docs/gateway.md advises for
  an engine with ``--max-num-seqs 4``), and replica A also serves a neighbour the gateway does not see (another
  gateway of a fleet, a batch job sent to it directly): ``--neighbour-streams`` closed-loop streams of 64 tokens,
  which keep its slots full. Today's routing sees A only through its waiting queue, after one of its own requests
  has queued there; the engine's running gauge says A is full before anything is sent.
- ``unequal``: no neighbour; A runs 2 sequences at a time, B 8, and the gateway is told nothing of it
  (``max_concurrent: 8`` for both). Today's routing sees A's queue and the tokens it holds longer; the engine-aware
  picker also learns A's slots from what it runs while it queues.

In each round both gateways take the same open-loop Poisson schedule (``tailguard bench --rate R --duration D
--seed S``: 32-token prompts, 32-token answers, streamed), one after the other, the order alternating from round to
round; the neighbour runs throughout. Reported per scenario and gateway: TTFT and E2E P50/P99 over every round's
requests (client-side, from the intended send), the share of requests the gateway sent to replica A, and the ratio
engine / tokens (below 1: engine-aware routing is faster). The replicas' engines are scripted, so their KV caches
report 0: the KV term of the engine-aware load is not exercised here (tests/backends/test_engine_state.py covers it).

Prints a table and writes benchmarks/results/engine_aware_routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engine_aware_routing.json"
ADMIN_KEY = "engine-aware-bench-admin"
FAKE = {"ttft": 0.05, "itl": 0.02, "itl_per_running": 0.005}
SCENARIOS: dict[str, dict[str, Any]] = {
    "neighbour": {"a": {"max_num_seqs": 4}, "b": {"max_num_seqs": 4}, "max_concurrent": 4, "neighbour": True},
    "unequal": {"a": {"max_num_seqs": 2}, "b": {"max_num_seqs": 8}, "max_concurrent": 8, "neighbour": False},
}
MODES = ("tokens", "engine")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def wait_ready(proc: subprocess.Popen, url: str, name: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not get ready in {timeout} s")


def serve(tmp: Path, name: str, cfg: dict[str, Any], *args: str) -> tuple[subprocess.Popen, str]:
    """A ``tailguard serve`` process on 127.0.0.1 with ``cfg`` as its config file, once /ready says 200."""
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--config",
           str(path), "--store", str(tmp / f"{name}.sqlite3"), "--no-access-log", "--log-level", "warning",
           "--no-slo", *args]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, name)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# --- the neighbour: traffic to replica A that no gateway sees ------------------------------------------------------
async def _neighbour(url: str, streams: int, max_tokens: int) -> None:
    import aiohttp

    body = {"model": "fake", "messages": [{"role": "user", "content": "a neighbour's long batch job " * 4}],
            "max_tokens": max_tokens, "stream": True}

    async def one(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    async for _ in resp.content.iter_any():
                        pass
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(streams)))


def neighbour_main(url: str, streams: int, max_tokens: int) -> None:
    asyncio.run(_neighbour(url, streams, max_tokens))


# --- one run ------------------------------------------------------------------------------------------------------
def replica_requests(gw: str) -> dict[str, int]:
    import httpx

    data = httpx.get(gw + "/admin/upstreams", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    return {d["url"]: d["requests"] for d in data["data"]}


def bench(gw: str, a: argparse.Namespace, seed: int, out: Path) -> list[dict[str, str]]:
    cmd = [sys.executable, "-m", "tailguard.cli", "bench", "--url", gw, "--rate", str(a.rate), "--duration",
           str(a.duration), "--input-tokens", "32", "--output-tokens", "32", "--warmup-requests", "4",
           "--seed", str(seed), "--output-dir", str(out), "--quiet", "--join", "off", "--no-probe",
           "--timeout", "60", "--failures-as-timeout"]
    subprocess.run(cmd, check=True, env=env(), stdout=subprocess.DEVNULL)
    with (out / "requests.csv").open(newline="", encoding="utf-8") as f:
        return [row for row in csv.DictReader(f) if row["warmup"] == "0"]


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(rows: list[dict[str, str]], timeout: float = 60.0) -> dict[str, Any]:
    """TTFT and E2E percentiles; a failed request counts at the timeout (``--failures-as-timeout``'s rule)."""
    ok = [r for r in rows if r["ok"] == "1"]
    failed = len(rows) - len(ok)
    ttft = [float(r["ttft_s"]) for r in ok if r["ttft_s"]] + [timeout] * failed
    e2e = [float(r["e2e_s"]) for r in ok if r["e2e_s"]] + [timeout] * failed
    return {"requests": len(rows), "failed": failed, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99)}


def run_scenario(name: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sc = SCENARIOS[name]
    procs: list[subprocess.Popen] = []
    try:
        reps = {}
        for rep in ("a", "b"):
            p, url = serve(tmp, f"{name}-replica-{rep}", {"fake": {**FAKE, **sc[rep]}, "slo": {"enabled": False}},
                           "--model", "fake")
            procs.append(p)
            reps[rep] = url
        gws = {}
        for mode in MODES:
            cfg = {"upstreams": [{"url": reps[r], "max_concurrent": sc["max_concurrent"]} for r in ("a", "b")],
                   "routing": {"load": mode, "engine_scrape_s": 0.5}, "admin_key": ADMIN_KEY,
                   "slo": {"enabled": False}}
            p, url = serve(tmp, f"{name}-gateway-{mode}", cfg)
            procs.append(p)
            gws[mode] = url
        if sc["neighbour"]:
            procs.append(subprocess.Popen([sys.executable, __file__, "--neighbour", reps["a"], "--neighbour-streams",
                                           str(a.neighbour_streams)], env=env(), stdout=subprocess.DEVNULL))
            time.sleep(2)  # its streams fill A's slots
        rows: dict[str, list[dict[str, str]]] = {m: [] for m in MODES}
        rounds: list[dict[str, Any]] = []
        for i in range(a.rounds):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                before = replica_requests(gws[mode])
                got = bench(gws[mode], a, a.seed + i, tmp / f"{name}-{mode}-{i}")
                after = replica_requests(gws[mode])
                to_a = after[reps["a"]] - before[reps["a"]]
                sent = sum(after.values()) - sum(before.values())
                rows[mode] += got
                rounds.append({"round": i, "mode": mode, **summary(got), "sent_to_a": to_a, "sent": sent})
                print(f"  {name} round {i} {mode:6}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in summary(got).items() if k.endswith("_s") and v is not None)
                    + f", {to_a}/{sent} to A", flush=True)
        pooled = {m: summary(rows[m]) for m in MODES}
        for m in MODES:
            ms = [r for r in rounds if r["mode"] == m]
            pooled[m]["share_to_a"] = sum(r["sent_to_a"] for r in ms) / max(1, sum(r["sent"] for r in ms))
        ratio = {k: (pooled["engine"][k] / pooled["tokens"][k]) if pooled["tokens"][k] else None
                 for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")}
        return {"scenario": name, "replicas": {r: {**FAKE, **sc[r]} for r in ("a", "b")},
                "max_concurrent": sc["max_concurrent"],
                "neighbour_streams": a.neighbour_streams if sc["neighbour"] else 0,
                "pooled": pooled, "ratio_engine_over_tokens": ratio, "rounds": rounds}
    finally:
        for p in reversed(procs):
            stop(p)


def table(results: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:,.0f}"

    lines = ["| scenario | routing | requests | TTFT P50 ms | TTFT P99 ms | E2E P50 ms | E2E P99 ms | to A |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        for m in MODES:
            p = r["pooled"][m]
            lines.append(f"| {r['scenario']} | {'today (tokens)' if m == 'tokens' else 'engine-aware'} | "
                         f"{p['requests']} | {ms(p['ttft_p50_s'])} | {ms(p['ttft_p99_s'])} | {ms(p['e2e_p50_s'])} | "
                         f"{ms(p['e2e_p99_s'])} | {p['share_to_a']:.0%} |")
        q = r["ratio_engine_over_tokens"]
        lines.append(f"| {r['scenario']} | ratio engine / today | | " + " | ".join(
            "-" if q[k] is None else f"{q[k]:.2f}x" for k in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s"))
            + " | |")
    return "\n".join(lines)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    p.add_argument("--rounds", type=int, default=2, help="rounds per scenario (each runs both gateways)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the bench's schedule per run")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s offered to the gateway (Poisson)")
    p.add_argument("--neighbour-streams", type=int, default=4)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--quick", action="store_true", help="one round of 15 s per scenario")
    p.add_argument("--neighbour", metavar="URL", help=argparse.SUPPRESS)  # the neighbour's own process
    p.add_argument("--output", type=Path, default=RESULTS)
    a = p.parse_args()
    if a.neighbour:
        neighbour_main(a.neighbour, a.neighbour_streams, 64)
        return 0
    if a.quick:
        a.rounds, a.duration = 1, 15.0
    scenarios = a.scenario or list(SCENARIOS)
    started = datetime.datetime.now(datetime.UTC)
    load_start = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="engine-aware-") as tmp:
        for name in scenarios:
            print(f"{name}:", flush=True)
            results.append(run_scenario(name, a, Path(tmp)))
    print()
    print(table(results))
    out = {"benchmark": "engine_aware_routing", "date": started.isoformat(timespec="seconds"),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "note": "shared and noisy: other jobs run on the same cores"},
           "load_average": {"start": load_start, "end": os.getloadavg()},
           "versions": {"tailguard": _version("tailguard"), "aiohttp": _version("aiohttp")},
           "command": " ".join(["benchmarks/engine_aware_routing.py", *sys.argv[1:]]),
           "settings": {"rounds": a.rounds, "duration_s": a.duration, "rate_rps": a.rate, "seed": a.seed,
                        "input_tokens": 32, "output_tokens": 32, "engine_scrape_s": 0.5},
           "results": results, "table": table(results)}
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {a.output.relative_to(ROOT) if a.output.is_relative_to(ROOT) else a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
