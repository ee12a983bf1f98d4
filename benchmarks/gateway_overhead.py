"""What the gateway adds: the same streams sent straight to an upstream and through ``tailguard serve --upstream``.

    .venv/bin/python benchmarks/gateway_overhead.py            # ~2 min; benchmarks/results/gateway_overhead.json
    .venv/bin/python benchmarks/gateway_overhead.py --streams 256 --tokens 40 --repeats 3
    # before/after a change, in one run: the gateway of another commit beside this one
    git archive BASE src | tar -x -C /tmp/base && .venv/bin/python benchmarks/gateway_overhead.py \
        --compare-src /tmp/base/src --repeats 5 --seconds 15

The upstream is a ``tailguard serve --model fake`` process, or with ``--upstream raw`` benchmarks/sse_upstream.py
(scripted TTFT and inter-token gap either way, so the upstream's own time is the same in both paths); the gateway is a second process in front of it. ``--streams`` closed-loop clients
(each sends its next streaming chat request when the last one ends, so the streams stay concurrent in steady state
and arrivals spread out), each request making ``--tokens`` tokens, run for ``--seconds`` and are read by an aiohttp
client in this process, with a fresh connection pool per round; repeats rotate over direct, through the gateway and
through each ``--compare-src`` gateway (the same upstream behind each). The gateway's CPU time per token
relayed is read from /proc. Reported per path: client-side TTFT P50/P99 and the gaps between tokens
P50/P99; the difference is the gateway's cost (issue 9's target: +1 ms P99 TTFT and +50 us per token at 256 streams).
All three processes share this machine's cores, so the figure includes the gateway's CPU taking time from the others;
``--pin`` gives the gateway a core of its own (the last one) and the upstream and the client the others, so that what
is measured is the gateway's own added time, not its competition with the load generator for a core.

``--nginx``: a fourth path through nginx (a C reverse proxy, unbuffered, pooled keep-alive connections to the
upstream; ``apt-get install nginx-light``), on the gateway's core. Any proxy adds two hops, and on a 2-core machine the
client and the upstream share a core, so each hop also waits for that core's loops: nginx's added time is what the
hops alone cost in this rig, and the gateway's figure minus nginx's is what its own work adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, name: str = "server", timeout: float = 180) -> None:
    """Block until a ``tailguard serve`` process answers ``/ready``; raise with its stderr if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}: the server exited: {proc.stderr.read()[-1500:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the server did not get ready")
        time.sleep(0.5)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def start(args: list[str], tmp: Path, cfg: dict, src: str | None = None, launcher: list[str] | None = None
          ) -> tuple[subprocess.Popen, str]:
    """A ``tailguard serve`` process; ``src``: run it from another source tree (a ``src`` folder) instead;
    ``launcher``: what runs the CLI instead of ``-m tailguard.cli`` (a script and its own arguments)."""
    port = free_port()
    path = tmp / f"cfg{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, *(launcher or ["-m", "tailguard.cli"]), "serve", "--port", str(port), "--config", str(path),
           "--store", str(tmp / f"r{port}.sqlite3"), "--no-access-log", "--log-level", "warning", *args]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(Path(src).resolve())
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=(tmp / f"serve{port}.log").open("wb"), env=env)
    return proc, f"http://127.0.0.1:{port}"


NGINX_CONF = """worker_processes 1;
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx.err warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx_body;
  proxy_temp_path {tmp}/nginx_proxy;
  upstream up {{ server 127.0.0.1:{up_port}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""


def start_nginx(tmp: Path, up_url: str) -> tuple[subprocess.Popen, str]:
    """nginx as a streaming reverse proxy in front of ``up_url`` (the hops' own cost, for comparison)."""
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if exe is None:
        raise SystemExit("--nginx: nginx is not installed (apt-get install nginx-light)")
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, up_port=up_url.rsplit(":", 1)[1], port=port))
    proc = subprocess.Popen([exe, "-c", str(conf), "-p", str(tmp)], stdout=subprocess.DEVNULL,
                            stderr=(tmp / "nginx.log").open("wb"))
    return proc, f"http://127.0.0.1:{port}"


async def ready(session: aiohttp.ClientSession, url: str) -> None:
    for _ in range(300):
        try:
            async with session.get(url + "/ready") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not get ready")


async def one(session: aiohttp.ClientSession, url: str, tokens: int) -> tuple[float, list[float]] | str:
    """TTFT and the gaps of one streamed request, or what went wrong (counted as an error, not timed)."""
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return f"{resp.status}: {(await resp.text())[:300]}"
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                # A chunk with text is a token; the role chunk (empty content), which a server may send before the
                # first token (vLLM, the gateway at the replica's head), is not. Parsed until the first token only.
                if not times and not (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content"):
                    continue
                times.append(time.perf_counter())
    if not times:
        return "no token"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return times[0] - t0, gaps


async def round_(session, url: str, streams: int, tokens: int, seconds: float = 0.0, warmup: float = 0.0,
                 poisson_rate: float | None = None, seed: int = 0) -> dict:
    """``streams`` closed-loop clients for ``seconds`` (0: one request each); requests started in the first
    ``warmup`` seconds are not timed (every client starts at once: the first wave is a thundering herd that no
    steady load has). ``poisson_rate``: instead, requests arrive open-loop at this rate (exponential gaps, seeded),
    for ``seconds``; with the rate at streams / request duration, about ``streams`` are in flight (Little's law)
    without the waves that equal-length closed-loop requests keep."""
    res: list[tuple[float, list[float]]] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    stop = t0 + seconds
    relayed = 0  # tokens of every request, timed or not (the gateway's CPU is read over the whole round)

    async def request(started: float) -> None:
        out = await one(session, url, tokens)
        nonlocal relayed
        relayed += 0 if isinstance(out, str) else len(out[1]) + 1
        if started >= t0 + warmup or isinstance(out, str):
            (errors if isinstance(out, str) else res).append(out)  # type: ignore[arg-type]

    async def client() -> None:
        while True:
            await request(time.perf_counter())
            if time.perf_counter() >= stop:
                return

    async def open_loop() -> None:
        rng = random.Random(seed)
        tasks, due = [], t0
        while due < stop:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(request(due)))
            due += rng.expovariate(poisson_rate)
        await asyncio.gather(*tasks)

    if poisson_rate:
        await open_loop()
    else:
        await asyncio.gather(*(client() for _ in range(streams)))
    if errors:
        print(f"  {url}: {len(errors)} requests failed, e.g. {errors[0]}", flush=True)
    ttft = [r[0] for r in res]
    gaps = [g for r in res for g in r[1]]
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50),
            "itl_p99": pct(gaps, 99), "itl_mean": statistics.fmean(gaps), "requests": len(res),
            "tokens": len(gaps) + len(res), "tokens_relayed": relayed, "errors": len(errors),
            "_ttft": ttft}  # every request's, for the percentiles pooled over rounds (not written out)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_raw_upstream(tmp: Path, ttft: float, itl: float) -> tuple[subprocess.Popen, str]:
    """benchmarks/sse_upstream.py on a free port: scripted timings at next to no CPU a token."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sse_upstream.py")), "--port", str(port),
                             "--ttft", str(ttft), "--itl", str(itl)],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "upstream.log").open("wb"))
    return proc, f"http://127.0.0.1:{port}"


GATEWAY_CFG = {"slo": {"enabled": False}, "capacity": {"max_concurrent": 4096},
               "lanes": {"standard": {"max_queue": 4096}}}


def start_gateway(tmp: Path, up_url: str, src: str | None = None, launcher: list[str] | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """``tailguard serve --upstream up_url`` with room for every stream (no lane or queue refuses one)."""
    return start(["--upstream", up_url, "--max-queue", "4096"], tmp, GATEWAY_CFG, src, launcher)


def start_gateways(tmp: Path, up_url: str, compare_src: list[str] | None) -> dict[str, tuple[subprocess.Popen, str]]:
    """``tailguard serve --upstream`` from this tree ("gateway") and from each other source tree
    ("gateway_compare1", ...), all in front of ``up_url``."""
    trees = {"gateway": None, **{f"gateway_compare{i + 1}": src for i, src in enumerate(compare_src or [])}}
    return {name: start_gateway(tmp, up_url, src) for name, src in trees.items()}


def pin(proxies: list[subprocess.Popen], others: list[subprocess.Popen]) -> None:
    """The proxies on the last core, the others (and this process) on the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("pinning needs at least 2 cores")
    for proc in proxies:
        os.sched_setaffinity(proc.pid, {cores[-1]})
    for proc in others:
        os.sched_setaffinity(proc.pid, set(cores[:-1]))
    os.sched_setaffinity(0, set(cores[:-1]))


async def main(a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tg-gw-"))
    if a.upstream == "raw":  # benchmarks/sse_upstream.py: next to no CPU per token, so the direct path does not queue
        up, up_url = start_raw_upstream(tmp, a.ttft, a.itl)
    else:
        fake = {"ttft": a.ttft, "itl": a.itl, "max_num_seqs": 4096, "output_text": "word "}
        up, up_url = start(["--model", "fake", "--max-queue", "4096"], tmp, {"fake": fake, "slo": {"enabled": False}})
    async with aiohttp.ClientSession() as session:
        await ready(session, up_url)
    gateways = start_gateways(tmp, up_url, a.compare_src)  # and the gateway of other source trees, in the same run
    proxies = {}
    if a.nginx:
        proxies["nginx"] = start_nginx(tmp, up_url)
    if a.pin:
        pin([proc for proc, _ in [*gateways.values(), *proxies.values()]], [up])
    out: dict = {"config": vars(a), "direct": [], **{name: [] for name in [*proxies, *gateways]}}
    paths = [("direct", up_url, None)] + [(name, url, proc) for name, (proc, url) in [*proxies.items(),
                                                                                     *gateways.items()]]
    try:
        def client() -> aiohttp.ClientSession:
            # A session per round: a pooled connection left idle while the other paths ran may have been closed by
            # the server's keep-alive timeout.
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300))

        async with client() as session:
            for _, url, _ in paths:
                await ready(session, url)
                await round_(session, url, 16, 4)  # warm code paths
        for rep in range(a.repeats):
            # Rotated: each path goes first once in a while (the shared machine's load drifts).
            order = paths[rep % len(paths):] + paths[:rep % len(paths)]
            for name, url, proc in order:
                async with client() as session:
                    cpu0 = cpu_seconds(proc.pid) if proc is not None else 0.0
                    rate = a.streams / (a.ttft + (a.tokens - 1) * a.itl) if a.arrivals == "poisson" else None
                    r = await round_(session, url, a.streams, a.tokens, a.seconds, a.warmup, rate, seed=rep)
                    if proc is not None:
                        r["gateway_cpu_us_per_token"] = (cpu_seconds(proc.pid) - cpu0) / r["tokens_relayed"] * 1e6
                out[name].append(r)
                print(f"repeat {rep + 1} {name}: " + ", ".join(
                    f"{k}={v * 1e3:.2f} ms" if k.startswith(("ttft", "itl")) else f"{k}={v:.0f}"
                    for k, v in r.items() if not k.startswith("_")), flush=True)
    finally:
        for p in [proc for proc, _ in [*gateways.values(), *proxies.values()]] + [up]:
            p.terminate()
            p.wait(20)
    return out


def report(res: dict) -> None:
    def med(path: str, k: str) -> float:
        return statistics.median(r[k] for r in res[path])

    gateways = [k for k in res if k.startswith("gateway") and isinstance(res[k], list)]
    proxies = [k for k in ("nginx",) if isinstance(res.get(k), list) and res[k]]
    print("\n| path | TTFT P50 | TTFT P99 | ITL P50 | ITL P99 |\n|---|---|---|---|---|")
    for path in ("direct", *proxies, *gateways):
        print(f"| {path} | {med(path, 'ttft_p50') * 1e3:.1f} ms | {med(path, 'ttft_p99') * 1e3:.1f} ms | "
              f"{med(path, 'itl_p50') * 1e3:.2f} ms | {med(path, 'itl_p99') * 1e3:.2f} ms |")
    for gw in gateways:
        added = {k: med(gw, k) - med("direct", k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_mean")}
        cpu = statistics.median(r["gateway_cpu_us_per_token"] for r in res[gw])
        suffix = gw.removeprefix("gateway")
        res["added" + suffix] = added
        res["gateway_cpu_us_per_token" + suffix] = cpu
        print(f"\nadded by {gw}: " + ", ".join(f"{k} {v * 1e3:+.2f} ms" for k, v in added.items()))
        print(f"{gw} CPU per token relayed (request handling included): {cpu:.0f} us")
    # Pooled: every round's requests together (a round's P99 is its 13th-worst request of ~1,300, so the median of
    # the rounds' P99s moves by a millisecond from run to run; the pooled P99 rests on ~100 requests).
    pooled = {path: {f"ttft_p{q}": pct([t for r in res[path] for t in r["_ttft"]], q) for q in (50, 99)}
              for path in ("direct", *proxies, *gateways)}
    res["pooled"] = pooled
    print("\npooled over the rounds: " + "; ".join(
        f"{path} TTFT P50 {v['ttft_p50'] * 1e3:.2f} ms, P99 {v['ttft_p99'] * 1e3:.2f} ms "
        f"(added {(v['ttft_p99'] - pooled['direct']['ttft_p99']) * 1e3:+.2f} ms)"
        for path, v in pooled.items()))
    for path in ("direct", *proxies, *gateways):
        for r in res[path]:
            r.pop("_ttft", None)
    for px in proxies:
        added = {k: med(px, k) - med("direct", k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_mean")}
        res["added_" + px] = added
        print(f"\nadded by {px} (the hops alone): " + ", ".join(f"{k} {v * 1e3:+.2f} ms" for k, v in added.items()))
        for gw in gateways:
            over = {k: med(gw, k) - med(px, k) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_mean")}
            res[f"{gw}_over_{px}"] = over
            print(f"{gw} over {px}: " + ", ".join(f"{k} {v * 1e3:+.2f} ms" for k, v in over.items()))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="closed-loop time per round")
    p.add_argument("--compare-src", action="append", metavar="SRC",
                   help="also run a gateway from this source folder (e.g. `git archive BASE src | tar -x -C DIR`, "
                        "then DIR/src), interleaved with the others: before and after a change in one run "
                        "(repeatable)")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of each round not timed (the start's herd)")
    p.add_argument("--pin", action="store_true", help="the gateway on a core of its own, upstream and client on the rest")
    p.add_argument("--arrivals", choices=["closed", "poisson"], default="closed",
                   help="closed: --streams clients, each sending its next request when the last ends; poisson: "
                        "open-loop arrivals at the rate that keeps --streams in flight (the same seed for every path)")
    p.add_argument("--upstream", choices=["tailguard", "raw"], default="tailguard",
                   help="tailguard: a `tailguard serve --model fake` upstream; raw: benchmarks/sse_upstream.py, the "
                        "same script at next to no CPU per token (the direct path then does not queue on 2 cores)")
    p.add_argument("--nginx", action="store_true",
                   help="also a path through nginx on the gateway's core: the two hops' own cost in this rig")
    p.add_argument("--out", default="benchmarks/results/gateway_overhead.json")
    args = p.parse_args()
    result = asyncio.run(main(args))
    report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
