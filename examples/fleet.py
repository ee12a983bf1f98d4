#!/usr/bin/env python3
"""A small tailguard fleet on one machine, driven by ``tailguard bench``.

    python examples/fleet.py                       # 20 s of load, then everything stops
    python examples/fleet.py --duration 60 --keep  # ... and keeps running until Ctrl-C (look around meanwhile)

What it starts (every process on 127.0.0.1, free ports, files under a temporary directory):

- Redis (``redis-server``): the gateways' shared rate limits, lane budgets and SLO windows;
- PostgreSQL (when its binaries are installed): one request store both gateways write to (SQLite files otherwise);
- 2 engine replicas: ``tailguard serve --model fake`` with fixed concurrency slots (``--replica-slots``) and scripted
  timings, standing in for GPU servers;
- 2 gateways: ``tailguard serve --upstream R1 --upstream R2 --redis URL --keys keys.yaml``;
- Prometheus (when installed), scraping the gateways and the replicas every second.

Then one ``tailguard bench`` per gateway (as clients behind a load balancer would split), with the key of a tenant
whose rate limit is shared by both gateways, and it prints where everything is: the gateways' dashboards
(``/slo``), the fleet's alerts (``/v1/alerts``, the same from either gateway), Prometheus, the bench reports.

It uses the repository's throwaway-server helpers (``tests/redis_server.py``, ``tests/pg_cluster.py``): run it
from a checkout, with the dev extra installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/redis_server.py, tests/pg_cluster.py: the throwaway servers
from tests.redis_server import RedisServer, free_port  # noqa: E402

ADMIN_KEY = "fleet-example-admin"


@dataclass
class Fleet:
    """What runs, and where."""

    workdir: Path
    redis: RedisServer
    store: str  # the gateways' request store (a postgresql:// URL, or "sqlite" when each has its own file)
    replicas: list[str] = field(default_factory=list)
    gateways: list[str] = field(default_factory=list)
    prometheus: str | None = None
    keys: dict[str, str] = field(default_factory=dict)  # tenant -> API key
    procs: list[subprocess.Popen] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"work directory   {self.workdir}", f"redis            {self.redis.url}",
                 f"request store    {self.store}"]
        lines += [f"replica {i}        {u}" for i, u in enumerate(self.replicas)]
        for i, u in enumerate(self.gateways):
            lines.append(f"gateway {i}        {u}   (dashboard {u}/slo, alerts {u}/v1/alerts, metrics {u}/metrics)")
        lines.append(f"prometheus       {self.prometheus or 'not installed (apt-get install prometheus)'}")
        lines.append(f"admin key        {ADMIN_KEY} (TAILGUARD_ADMIN_KEY of the gateways)")
        return "\n".join(lines)


def _wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} on {url} did not get ready in {timeout:g} s")


def _serve(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})})


def start_replica(workdir: Path, name: str, slots: int, ttft: float, itl: float) -> tuple[str, subprocess.Popen]:
    """A fake engine replica: ``slots`` sequences at a time (more wait in its own queue), scripted timings."""
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"fake": {"ttft": ttft, "itl": itl, "max_num_seqs": slots},
                                   "slo": {"enabled": False}}))
    proc = _serve(["--model", "fake", "--port", str(port), "--config", str(cfg), "--store",
                   str(workdir / f"{name}.sqlite3"), "--no-access-log", "--log-level", "warning"],
                  workdir / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc, name)
    return url, proc


def start_gateway(workdir: Path, name: str, replicas: list[str], slots: int, redis_url: str | None, store: str,
                  keys_file: Path | None, slo_dry_run: bool = True) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"upstreams": [{"url": u, "max_concurrent": slots} for u in replicas]}))
    args = ["--port", str(port), "--config", str(cfg), "--no-access-log", "--log-level", "warning",
            "--store", store if store.startswith("postgresql://") else str(workdir / f"{name}.sqlite3")]
    if redis_url:
        args += ["--redis", redis_url]
    if keys_file is not None:
        args += ["--keys", str(keys_file)]
    if slo_dry_run:
        args.append("--slo-dry-run")  # judged and recorded, not acted on: the load is the example's to shape
    proc = _serve(args, workdir / f"{name}.log", {"TAILGUARD_ADMIN_KEY": ADMIN_KEY})
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, proc, name)
    return url, proc


def start_prometheus(workdir: Path, targets: list[str]) -> tuple[str, subprocess.Popen] | None:
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    port = free_port()
    cfg = workdir / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "tailguard",
                            "static_configs": [{"targets": [t.removeprefix("http://") for t in targets]}]}],
    }))
    proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'prometheus'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=(workdir / "prometheus.log").open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return url, proc
        time.sleep(0.2)
    proc.terminate()
    return None


def _postgres(stack: contextlib.ExitStack) -> str | None:
    """A throwaway PostgreSQL's URL (stopped with the stack), or None where it cannot run here."""
    try:
        from tests.pg_cluster import ClusterUnavailable, PgCluster
    except ImportError:
        return None
    try:
        pg = PgCluster()
    except ClusterUnavailable:
        return None
    stack.callback(pg.destroy)
    db = stack.enter_context(pg.database())
    return db


@contextlib.contextmanager
def fleet(n_gateways: int = 2, n_replicas: int = 2, replica_slots: int = 4, ttft: float = 0.2, itl: float = 0.02,
          redis: bool = True, postgres: bool = True, prometheus: bool = True,
          tenants: dict[str, dict] | None = None, workdir: Path | None = None) -> Iterator[Fleet]:
    """Start a fleet; stop every process at exit. ``redis=False``: the gateways share nothing (the baseline)."""
    from tailguard.gateway.tenants import KeyFile

    with contextlib.ExitStack() as stack:
        wd = workdir or Path(tempfile.mkdtemp(prefix="tailguard-fleet-"))
        wd.mkdir(parents=True, exist_ok=True)
        server = RedisServer().start()
        stack.callback(server.stop)
        store = (_postgres(stack) if postgres else None) or "sqlite"
        f = Fleet(wd, server, store)

        def stop_all() -> None:
            for p in reversed(f.procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in f.procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()

        stack.callback(stop_all)
        keys_file = None
        if tenants:
            kf = KeyFile()
            f.keys = {name: kf.add_key(name, **cfg) for name, cfg in tenants.items()}
            keys_file = wd / "keys.yaml"
            kf.save(keys_file)
        for i in range(n_replicas):
            url, proc = start_replica(wd, f"replica{i}", replica_slots, ttft, itl)
            f.replicas.append(url)
            f.procs.append(proc)
        for i in range(n_gateways):  # one after the other: the first creates the shared store's schema
            url, proc = start_gateway(wd, f"gateway{i}", f.replicas, replica_slots,
                                      server.url if redis else None, store, keys_file)
            f.gateways.append(url)
            f.procs.append(proc)
        if prometheus:
            prom = start_prometheus(wd, f.gateways + f.replicas)
            if prom is not None:
                f.prometheus = prom[0]
                f.procs.append(prom[1])
        yield f


def bench(fl: Fleet, rate: float, duration: float, key: str | None, output_tokens: int) -> list[Path]:
    """One ``tailguard bench`` per gateway, side by side; their output directories."""
    procs, outs = [], []
    for i, gw in enumerate(fl.gateways):
        out = fl.workdir / f"bench-gateway{i}"
        cmd = [sys.executable, "-m", "tailguard.cli", "bench", "--url", gw, "--rate", str(rate), "--duration",
               str(duration), "--output-tokens", str(output_tokens), "--input-tokens", "64", "--output-dir", str(out),
               "--label", f"gateway{i}", "--quiet", "--seed", str(i)]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        if key:
            env["TAILGUARD_API_KEY"] = key
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    for p in procs:
        p.wait()
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20, help="seconds of load")
    p.add_argument("--rate", type=float, default=10, help="requests/s sent to each gateway")
    p.add_argument("--replica-slots", type=int, default=4, help="concurrent sequences per fake replica")
    p.add_argument("--tenant-rate", type=float, default=12, help="the tenant's requests/s, shared by the fleet")
    p.add_argument("--keep", action="store_true", help="keep the fleet running after the load, until Ctrl-C")
    a = p.parse_args()
    tenants = {"acme": {"lane": "standard", "requests_per_s": a.tenant_rate, "burst_s": 2.0}}
    with fleet(replica_slots=a.replica_slots, tenants=tenants) as fl:
        print(fl.describe(), flush=True)
        print(f"\ndriving both gateways for {a.duration:g} s at {a.rate:g} requests/s each, as tenant 'acme' "
              f"(its limit, {a.tenant_rate:g} requests/s, is held by the fleet: expect 429s beyond it)\n", flush=True)
        outs = bench(fl, a.rate, a.duration, fl.keys["acme"], output_tokens=16)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        print()
        for i, out in enumerate(outs):
            with contextlib.suppress(OSError, ValueError, KeyError):
                summ = json.loads((out / "results.json").read_text())["summary"]
                req = summ["requests"]
                print(f"gateway {i}: {req['completed']} completed, {req['failed']} failed "
                      f"{summ['errors_by_kind'] or ''}")
            print(f"bench report for gateway {i}: {out / 'report.html'}")
        with contextlib.suppress(httpx.HTTPError):
            alerts = httpx.get(fl.gateways[0] + "/v1/alerts", headers=admin, timeout=5).json()
            print(f"fleet alerts and actions so far (the same from either gateway): "
                  f"{len(alerts.get('data', alerts) if isinstance(alerts, dict) else alerts)}")
        if a.keep:
            print("\nthe fleet keeps running; Ctrl-C stops it", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
