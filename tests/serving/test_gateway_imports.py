"""A gateway does not load torch: its modules and the ``tailguard serve --upstream`` path import only torch-free code
(the token events come from ``tailguard.engine.events``, not the engine). Checked in a fresh interpreter, where
nothing else has imported torch yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

_PROBE = """
import json, sys
import tailguard.policy.lanes, tailguard.observe.gateway_metrics, tailguard.backends.upstream.proxy, tailguard.policy.fleet_state
import tailguard.backends.upstream.sse, tailguard.backends.stall_watch, tailguard.policy.tenants, tailguard.backends.upstream.pool
after_gateway = "torch" in sys.modules
import tailguard.cli
from tailguard.serving.app import create_app
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.config import ServerConfig
config = ServerConfig.load(None, upstreams=[{"url": "http://127.0.0.1:9"}])
backend = build_backend(config)  # what `tailguard serve --upstream URL` builds, without serving
create_app(config, engine_factory=lambda: backend)
print(json.dumps({"after_gateway": after_gateway, "after_cli": "torch" in sys.modules,
                  "backend": type(backend).__name__}))
"""


def test_gateway_and_its_serve_path_do_not_import_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["backend"] == "UpstreamBackend"
    assert res["after_gateway"] is False, "importing the gateway loaded torch"
    assert res["after_cli"] is False, "the `serve --upstream` path loaded torch"
