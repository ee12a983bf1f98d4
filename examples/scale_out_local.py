#!/usr/bin/env python3
"""A scale-out hook for a gateway on one machine: starts another ``tailguard serve`` replica and adds it to the gateway.

The SLO monitor runs this command with the hook's JSON on stdin (``slo.actions.scale_out.command`` in the gateway's
config) when a tier asks for more replicas; the JSON carries ``replicas`` (the gateway's replica set). On
``scale_out`` it starts ``--model`` on the next free port, waits until it is ready, and POSTs it to the gateway's
``/admin/upstreams``; on ``scale_in`` it removes the newest replica it started (the process is left to finish its
requests and is then stopped).

    slo:
      actions:
        scale_out:
          command: ["python", "examples/scale_out_local.py", "--gateway", "http://127.0.0.1:8000", "--model", "smollm2"]

The admin key comes from TAILGUARD_ADMIN_KEY (never from the command line, where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STATE = Path(os.environ.get("TAILGUARD_HOME", Path.home() / ".local/share/tailguard")) / "local-replicas.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gateway", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-concurrent", type=int, default=16)
    p.add_argument("--ready-timeout", type=float, default=120)
    a = p.parse_args()
    hook = json.load(sys.stdin)
    headers = {"Authorization": f"Bearer {os.environ.get('TAILGUARD_ADMIN_KEY', '')}"}
    started = json.loads(STATE.read_text()) if STATE.exists() else []
    if hook.get("action") == "scale_in":
        if not started:
            print("nothing this script started is left to remove")
            return 0
        last = started.pop()
        httpx.delete(f"{a.gateway}/admin/upstreams/{last['name']}", headers=headers, timeout=10)
        STATE.write_text(json.dumps(started))
        subprocess.Popen(["sh", "-c", f"sleep 60; kill {last['pid']}"], start_new_session=True)
        print(f"removed {last['name']}; its process stops in 60 s")
        return 0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--model", a.model, "--port", str(port),
                             "--no-slo"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + a.ready_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        print(f"the new replica on {url} did not get ready", file=sys.stderr)
        return 1
    r = httpx.post(f"{a.gateway}/admin/upstreams", json={"url": url, "max_concurrent": a.max_concurrent},
                   headers=headers, timeout=30)
    r.raise_for_status()
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps([*started, {"name": r.json()["name"], "url": url, "pid": proc.pid}]))
    print(f"added {url} ({len(hook.get('replicas', [])) + 1} replicas now)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
