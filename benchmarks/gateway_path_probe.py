"""``tailguard serve`` with a stamp at each point of a request's way to its first token, for gateway_ttft_path.py.

    python benchmarks/gateway_path_probe.py OUT.json serve --upstream URL ...     # the arguments of tailguard serve

Wraps (from outside: no change to tailguard) uvicorn's read of the client's bytes, the start of the request's task,
the upstream connection's write of the request and its read of the first token, and the write of the first token's
chunk to the client (by uvicorn's ``send``, or by the direct relay's ``first_token`` from the upstream's read, in a
build that has it); each request's stamps (``time.perf_counter_ns``) are written to OUT.json at exit (SIGINT).
The wrappers cost ~1 us a stamp, the same in every build measured.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import re
import sys
from time import perf_counter_ns as now
from typing import Any

import uvicorn.protocols.http.httptools_impl as uv

from tailguard.backends.upstream import http1

OUT = sys.argv.pop(1)
TOKEN = re.compile(rb'"content":\s*"[^"]')  # a chunk with text: the role chunk's content is empty
STAMPS = ("read", "task", "run", "up_write", "up_written", "up_token", "token_write", "token_written")
cycles: list[Any] = []
by_task: dict[asyncio.Task, Any] = {}


def _wrap(cls: type, name: str, make: Any) -> None:
    setattr(cls, name, make(getattr(cls, name)))


def _read(orig: Any) -> Any:
    def data_received(self: Any, data: bytes) -> None:
        self._tg_read = now()
        return orig(self, data)
    return data_received


def _task(orig: Any) -> Any:
    def start(self: Any, cycle: Any, app: Any) -> None:
        cycle._tg = {"read": self._tg_read, "task": now()}
        cycles.append(cycle)
        return orig(self, cycle, app)
    return start


def _run(orig: Any) -> Any:
    async def run_asgi(self: Any, app: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        by_task[task] = self
        self._tg["run"] = now()
        try:
            return await orig(self, app)
        finally:
            by_task.pop(task, None)
    return run_asgi


def _send(orig: Any) -> Any:
    async def send(self: Any, message: Any) -> None:
        t = now()
        await orig(self, message)
        if "token_write" not in self._tg and message.get("type") == "http.response.body" \
                and TOKEN.search(message.get("body", b"")):
            self._tg["token_write"], self._tg["token_written"] = t, now()
    return send


def _up_write(orig: Any) -> Any:
    def send(self: Any, data: bytes) -> None:
        t = now()
        orig(self, data)
        cycle = by_task.get(asyncio.current_task())  # type: ignore[arg-type]
        if cycle is not None and "up_write" not in cycle._tg:
            cycle._tg["up_write"], cycle._tg["up_written"] = t, now()
        self._tg_cycle = cycle
    return send


def _up_read(orig: Any) -> Any:
    def data_received(self: Any, data: bytes) -> None:
        cycle = getattr(self, "_tg_cycle", None)
        if cycle is not None and "up_token" not in cycle._tg and TOKEN.search(data):
            cycle._tg["up_token"] = now()
        return orig(self, data)
    return data_received


def _first_token(orig: Any) -> Any:
    def first_token(self: Any, text: str) -> bool:
        t = now()
        written = orig(self, text)
        tg = getattr(self._cycle, "_tg", None)
        if written and tg is not None and "token_write" not in tg:
            tg["token_write"], tg["token_written"] = t, now()
        return written
    return first_token


_wrap(uv.HttpToolsProtocol, "data_received", _read)
_wrap(uv.HttpToolsProtocol, "_start_asgi_task", _task)
_wrap(uv.RequestResponseCycle, "run_asgi", _run)
_wrap(uv.RequestResponseCycle, "send", _send)
_wrap(http1.Connection, "send", _up_write)
_wrap(http1.Connection, "data_received", _up_read)
try:
    from tailguard.serving.client_relay import ClientRelay
except ImportError:  # a build without the direct relay
    ClientRelay = None  # type: ignore[assignment,misc]
if ClientRelay is not None and hasattr(ClientRelay, "first_token"):
    _wrap(ClientRelay, "first_token", _first_token)


@atexit.register
def _dump() -> None:
    rows = [[c._tg.get(k, 0) for k in STAMPS] for c in cycles]
    with open(OUT, "w") as f:
        json.dump({"stamps": STAMPS, "requests": rows}, f)


if __name__ == "__main__":
    from tailguard.cli import main

    sys.argv = ["tailguard", *sys.argv[1:]]
    sys.exit(main())
