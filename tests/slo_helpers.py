"""Helpers for the SLO tests: a fake clock, a server with a controllable fake engine, a local webhook receiver."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.serving.server import ThreadedServer
from tailguard.slo.config import MonitorConfig
from tests.serving_helpers import make_config, settle


class FakeClock:
    """Unix seconds that move only when the test says so (slot-aligned start)."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# Tiers scaled to the fake engine: E2E ~ its TTFT when max_tokens is 1. Gaps are wide because a loaded CI machine
# adds tens of milliseconds to a request.
TEST_SLO: dict[str, Any] = {
    "slot_s": 1.0,
    "peak_window_s": 1.0,  # one slot: each evaluation sees only the requests of its own phase
    "offpeak_window_s": 1.0,
    "eval_interval_s": 3600.0,  # the tests evaluate by hand, on their fake clock
    "peak": {"mode": "never"},
    # One judged metric (E2E, the shorthand) so that a test controls the tier with one number; no dwell, so that
    # the tier follows each phase at once.
    "tiers": {"yellow": 0.3, "orange": 0.6, "red": 0.9, "clear_ratio": 0.7, "clear_after": 2, "min_samples": 5,
              "min_dwell_s": 0},
    "golden_rules": {"min_samples": 5},
    "objective_min_samples": 5,
    "actions": {
        "shed": {"non_core_business_types": ["batch"], "status": 429, "retry_after_s": 7},
        # The template is opt-in (the default truncates); the server tests cover it with a text they can spot.
        "degrade": {"mode": "template", "template": "Busy: a short answer for now.", "probe_every": 2},
    },
}


def slo_config(**over: Any) -> MonitorConfig:
    data = json.loads(json.dumps(TEST_SLO))

    def merge(a: dict, b: dict) -> None:
        for k, v in b.items():
            if isinstance(v, dict) and isinstance(a.get(k), dict):
                merge(a[k], v)
            else:
                a[k] = v

    merge(data, over)
    return MonitorConfig.model_validate(data)


@contextlib.contextmanager
def slo_server(tmp: Path, clock: FakeClock | None = None, slo: MonitorConfig | None = None,
               engine: FakeEngine | None = None, **server_cfg: Any) -> Iterator[ThreadedServer]:
    engine = engine or FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    cfg = make_config(tmp, slo=slo or slo_config(), **server_cfg)
    with ThreadedServer(cfg, engine, slo_clock=clock) as server:
        yield server


def chat(url: str, client: httpx.Client | None = None, business_type: str = "chat", stream: bool = False,
         **headers: str) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": stream}
    hdrs = {"x-business-type": business_type, **headers}
    c = client or httpx
    return c.post(url + "/v1/chat/completions", json=body, headers=hdrs, timeout=30)


def burst(server: ThreadedServer, n: int, business_type: str = "chat") -> list[httpx.Response]:
    """``n`` concurrent chat requests; returns once every record is closed."""
    with httpx.Client() as client, ThreadPoolExecutor(n) as pool:
        out = list(pool.map(lambda _: chat(server.url, client, business_type), range(n)))
    settle(server)
    return out


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps every JSON body POSTed to it."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.bodies: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                if delay_s:
                    time.sleep(delay_s)
                receiver.bodies.append(json.loads(raw))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that timed out on purpose (the hanging-webhook test) is no error here

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/scale"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.bodies) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.bodies)
