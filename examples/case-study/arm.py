#!/usr/bin/env python3
"""One arm of the case study: two engine replicas and the gateway in front of them, as one endpoint.

    python examples/case-study/arm.py before --port 8000 --work DIR
    python examples/case-study/arm.py after  --port 8000 --work DIR
    python examples/case-study/arm.py after-peak --port 8000 --work DIR    # the third replica up for the peak

``DIR`` holds what ``case_study.py`` wrote: ``replica.yaml`` (the replicas' engine), ``before.yaml``, ``after.yaml``
and ``after-peak.yaml`` (the gateway of each arm) and ``keys.yaml``. The replicas start on free ports, the gateway on
``--port`` once they answer; SIGTERM (or SIGINT) stops the gateway first (it drains, and stops any replica its
provider started), then the replicas. The bench's A/B runner starts this as an arm's command.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], log: Path) -> subprocess.Popen:
    out = log.open("ab")
    return subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", *args], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url}: not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arm", choices=["before", "after", "after-peak"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--work", type=Path, required=True)
    args = p.parse_args()
    work: Path = args.work
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%H%M%S")
    replicas: list[subprocess.Popen] = []
    gateway: subprocess.Popen | None = None
    stopping = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        urls = []
        for i in (1, 2):
            port = free_port()
            replicas.append(serve(["--model", "fake", "--config", str(work / "replica.yaml"), "--port", str(port),
                                   "--store", str(work / f"{args.arm}-replica{i}-{stamp}.sqlite3"), "--no-slo",
                                   "--no-access-log", "--log-level", "warning"],
                                  logs / f"{args.arm}-replica{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, replicas, strict=True):
            wait_ready(url, proc)
        cfg = (work / f"{args.arm}.yaml").read_text().replace("{replica1}", urls[0]).replace("{replica2}", urls[1])
        cfg_path = work / f"{args.arm}-{stamp}.yaml"
        cfg_path.write_text(cfg)
        gw_args = ["--config", str(cfg_path), "--port", str(args.port), "--store",
                   str(work / f"{args.arm}-gateway-{stamp}.sqlite3"), "--no-access-log", "--log-level", "warning"]
        if args.arm.startswith("after"):
            gw_args += ["--keys", str(work / "keys.yaml")]
        else:
            gw_args += ["--no-slo"]
        gateway = serve(gw_args, logs / f"{args.arm}-gateway.log")
        wait_ready(f"http://127.0.0.1:{args.port}", gateway, timeout=120)
        print(f"{args.arm}: gateway on :{args.port} over {', '.join(urls)}", flush=True)
        while not stopping and gateway.poll() is None and all(r.poll() is None for r in replicas):
            time.sleep(0.2)
        return 0 if stopping else 1
    finally:
        if gateway is not None:
            stop(gateway, grace=60.0)  # it drains, and stops what its provider started
        for proc in replicas:
            stop(proc)


if __name__ == "__main__":
    raise SystemExit(main())
