"""Run the app under uvicorn with uvloop and httptools; plus a thread runner for tests and benchmarks.

The HTTP protocol is uvicorn's httptools one with the connection limits it lacks (serving/connections.py), and the
server drains before uvicorn's own shutdown (serving/drain.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from tailguard.backends.base import Backend
from tailguard.backends.local import LocalEngine
from tailguard.observe.stores import describe_store_target
from tailguard.serving.app import create_app
from tailguard.serving.backend_factory import build_backend
from tailguard.serving.config import ServerConfig
from tailguard.serving.connections import ConnectionGuard, ConnectionLimits, connection_cap
from tailguard.serving.drain import Drain

log = logging.getLogger("tailguard.server")


def _uvicorn_config(app: Any, config: ServerConfig, guard: ConnectionGuard | None = None,
                    **extra: Any) -> uvicorn.Config:
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it anyway
        loop = "asyncio"
    guard = guard or ConnectionGuard(ConnectionLimits.from_config(config))
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=loop,
        http=guard.protocol_class(),  # httptools, with head/body limits and timeouts and a connection cap
        ws="none",  # no WebSocket routes; an upgrade would also take the connection out of the guard's count
        lifespan="on",
        log_level=config.log_level,
        access_log=config.access_log,
        # Rounded up, never to None: uvicorn reads None as "wait forever", and 0.5 s must not mean that.
        timeout_graceful_shutdown=math.ceil(config.graceful_shutdown_s),
        timeout_keep_alive=config.keepalive_timeout_s,  # type: ignore[arg-type]  # typed int, used as call_later's float
        server_header=False,
        **extra,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the app's requests (serving/drain.py) before its own shutdown, listener open."""

    def __init__(self, config: uvicorn.Config, app: Any, guard: ConnectionGuard, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.tailguard_app = app
        self.guard = guard
        self.drain_timeout_s = drain_timeout_s
        self.drain: Drain | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.tailguard_app.state, "tailguard", None)
        if state is not None and self.drain is None:
            began = time.monotonic()
            self.guard.begin_drain(self.server_state.connections)
            self.drain = Drain(state.admission, self.drain_timeout_s)
            await self.drain.run(lambda: self.force_exit)
            # What is left (a /metrics scrape, a request body still arriving) gets the rest of the drain timeout.
            left = self.drain_timeout_s - (time.monotonic() - began)
            self.config.timeout_graceful_shutdown = max(1, math.ceil(left))
        await super().shutdown(sockets)


def _server(app: Any, config: ServerConfig, own_process: bool) -> DrainingServer:
    guard = ConnectionGuard(ConnectionLimits.from_config(config, connection_cap(config, raise_limit=own_process)))
    state = getattr(app.state, "tailguard", None)
    if state is not None and state.metrics is not None:
        state.metrics.connection_source = guard
    return DrainingServer(_uvicorn_config(app, config, guard), app, guard, config.graceful_shutdown_s)


def store_problem(config: ServerConfig) -> str | None:
    """Why the request store cannot be opened (a directory, a file that is not a database, another application's
    database, a newer schema, an unreachable PostgreSQL), said in one line before the server starts, or None. A SQLite
    file gets its schema and key here, as the server would (no writer, no retention sweep: the server's store runs
    those); a PostgreSQL store is opened and closed."""
    from pathlib import Path

    from tailguard.observe.store import (
        check_store_target,
        first_line,
        is_postgres_url,
        load_secret,
        sqlite_path,
    )
    from tailguard.observe.store_sqlite import open_schema
    from tailguard.observe.stores import open_store

    try:
        check_store_target(config.store_path)
        if is_postgres_url(config.store_path):
            open_store(config.store_path, retention_days=config.retention_days).close()
        else:
            path = sqlite_path(config.store_path)
            if path != ":memory:":
                Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            open_schema(path, load_secret(path))
    except Exception as exc:  # noqa: BLE001 - whatever it is, the server cannot start on it: say so in one line
        return first_line(exc)
    return None


def serve(config: ServerConfig, engine_args: Any | None = None) -> int:
    """``tailguard serve``: blocks until SIGINT/SIGTERM."""
    logging.basicConfig(level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = store_problem(config)
    if problem is not None:
        print(f"tailguard serve: cannot open the request store {describe_store_target(config.store_path)}: {problem}",
              file=sys.stderr)
        return 2
    app = create_app(config, engine_factory=lambda: build_backend(config, engine_args), own_process=True)
    server = _server(app, config, own_process=True)
    log.info("tailguard serving %s on http://%s:%d (store: %s, text storage %s)", config.model, config.host,
             config.port, describe_store_target(config.store_path), "on, redacted" if config.store_text else "off")
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn shuts down cleanly on Ctrl-C, then raises the signal again for the caller: that is an exit, not
        # an error (128 + SIGINT, as a shell reports it).
        return 130
    return 0


class ThreadedServer:
    """uvicorn in a background thread on an ephemeral loopback port: ``with ThreadedServer(cfg, engine) as s:``."""

    def __init__(self, config: ServerConfig, engine: Backend | LocalEngine | None = None, redactor: Any | None = None,
                 engine_factory: Callable[[], Backend | LocalEngine] | None = None, slo_clock: Any | None = None) -> None:
        self.config = config
        self.app = create_app(config, engine=engine, engine_factory=engine_factory, redactor=redactor,
                              slo_clock=slo_clock)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((config.host, config.port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{config.host}:{self.port}"
        self.server = _server(self.app, config, own_process=False)
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
