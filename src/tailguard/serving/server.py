"""Run the app under uvicorn with uvloop and httptools; plus a thread runner for tests and benchmarks."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from typing import Any

import uvicorn

from tailguard.observe.store import describe_store_target
from tailguard.serving.app import create_app
from tailguard.serving.backend import Backend, build_backend
from tailguard.serving.config import ServerConfig

log = logging.getLogger("tailguard.server")


def _uvicorn_config(app: Any, config: ServerConfig, **extra: Any) -> uvicorn.Config:
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it anyway
        loop = "asyncio"
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        http="httptools",
        lifespan="on",
        log_level=config.log_level,
        access_log=config.access_log,
        # Rounded up, never to None: uvicorn reads None as "wait forever", and 0.5 s must not mean that.
        timeout_graceful_shutdown=math.ceil(config.graceful_shutdown_s),
        server_header=False,
        **extra,
    )


def serve(config: ServerConfig, engine_args: Any | None = None) -> int:
    """``tailguard serve``: blocks until SIGINT/SIGTERM."""
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config, engine_factory=lambda: build_backend(config, engine_args), own_process=True)
    server = uvicorn.Server(_uvicorn_config(app, config))
    log.info("tailguard serving %s on http://%s:%d (store: %s, text storage %s)", config.model, config.host,
             config.port, describe_store_target(config.store_path), "on, redacted" if config.store_text else "off")
    server.run()
    return 0


class ThreadedServer:
    """uvicorn in a background thread on an ephemeral loopback port: ``with ThreadedServer(cfg, engine) as s:``."""

    def __init__(self, config: ServerConfig, engine: Backend | None = None, redactor: Any | None = None,
                 engine_factory: Any | None = None, slo_clock: Any | None = None) -> None:
        self.config = config
        self.app = create_app(config, engine=engine, engine_factory=engine_factory, redactor=redactor,
                              slo_clock=slo_clock)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.host, config.port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{config.host}:{self.port}"
        self.server = uvicorn.Server(_uvicorn_config(self.app, config))
        self._thread = threading.Thread(target=self._run, name="tailguard-test-server", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def state(self):
        return self.app.state.tailguard

    def _run(self) -> None:
        self.server.run(sockets=[self._sock])

    def start(self, timeout: float = 30.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
