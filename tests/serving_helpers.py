"""Shared helpers for the server tests: servers on 127.0.0.1 with an ephemeral port, and a shared tiny engine."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.serving.config import ServerConfig
from tailguard.serving.server import ThreadedServer
from tests.net import free_port

# The test servers' admin key (records, alerts and SLO data are admin surfaces: closed without one).
ADMIN_KEY = "test-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def make_config(tmp: Path, **kw: Any) -> ServerConfig:
    kw.setdefault("model", "fake")
    kw.setdefault("admin_key", ADMIN_KEY)
    kw.setdefault("store_path", str(tmp / "requests.sqlite3"))
    return ServerConfig(host="127.0.0.1", port=0, access_log=False, log_level="warning", **kw)


@contextlib.contextmanager
def fake_server(tmp: Path, timing: FakeTiming | None = None, engine: Any | None = None, redactor: Any | None = None,
                **cfg: Any) -> Iterator[ThreadedServer]:
    engine = engine or FakeEngine(timing or FakeTiming(ttft=0.005, itl=0.001))
    with ThreadedServer(make_config(tmp, **cfg), engine, redactor=redactor) as server:
        yield server


@contextlib.contextmanager
def read_during(delay_s: float, read: Callable[[], Any]) -> Iterator[list]:
    """``read()`` once, ``delay_s`` into the block, from a thread (while the block waits on a request); the list
    holds what it returned once the block is left."""
    got: list = []

    def run() -> None:
        time.sleep(delay_s)
        got.append(read())

    t = threading.Thread(target=run)
    t.start()
    try:
        yield got
    finally:
        t.join()


def settle(server: ThreadedServer, timeout: float = 10.0) -> None:
    """Wait until no request is in flight (each has closed its record), then until the store has committed them.

    A response reaches the client before its record closes (the record holds the time its last byte was sent).
    """
    deadline = time.monotonic() + timeout
    while server.state.admission.in_flight > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.state.admission.in_flight} requests still in flight")
        time.sleep(0.005)
    assert server.state.store.flush(timeout)


@functools.cache
def tiny_engine():
    """One random-weight tiny model (real tokenizer) for the whole test session; shut down at exit."""
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_args(EngineArgs(model="tiny", kv_cache_tokens=4096, max_num_seqs=16,
                                                 max_num_batched_tokens=256, num_threads=1))
    atexit.register(engine.shutdown)
    return engine


def open_stream(url: str, body: dict, request_id: str) -> socket.socket:
    """POST a chat request over a raw socket (so a test can hang up at any moment); returns the socket."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"X-Request-ID: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def wait_until(pred, timeout: float = 20.0, interval: float = 0.01) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()



def start_serve(*args: str, port: int | None = None, timeout: float = 60.0) -> tuple[Any, str]:
    """``tailguard serve ARGS --port P`` as a user runs it (a subprocess, stdout and stderr captured), once /ready
    says yes; returns the process and its URL. The caller stops it."""
    import subprocess
    import sys

    import httpx

    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tailguard.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stdout.read()[-3000:] if proc.stdout else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the server did not become ready")
        time.sleep(0.1)


def stop_serve(proc: Any, timeout: float = 30.0) -> str:
    """SIGTERM a ``start_serve`` process, as a supervisor stops it; returns its output. uvicorn shuts down gracefully,
    then re-raises SIGTERM, so the exit status says how it ended: 0 or -SIGTERM is a clean stop."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode in (0, -signal.SIGTERM), out
    return out or ""


class FailingEngine(FakeEngine):
    """The fake engine, except that a request whose id starts with ``boom`` fails inside the engine (a 500)."""

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0, arrival_time=None):
        if request_id.startswith("boom"):
            raise RuntimeError("the engine broke")
        async for ev in super().generate(prompt_token_ids, sampling, request_id, priority, arrival_time):
            yield ev
