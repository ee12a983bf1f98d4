"""``/health`` (the process is alive), ``/ready`` (requests can be served) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailguard.observe.metrics import CONTENT_TYPE
from tailguard.serving.state import state_of


async def health(request: Request) -> Response:
    state = state_of(request)
    failed = state.engine_error()
    if failed is not None or state.load_error:
        return JSONResponse({"status": "failed", "error": str(failed or state.load_error)[:500]}, 503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = state_of(request)
    if state.admission.drain is not None:  # SIGTERM: out of rotation first (serving/drain.py)
        return JSONResponse({"status": "draining", "error": "the server is shutting down"}, 503)
    if state.ready and state.engine is not None and state.engine_error() is None:
        why = state.engine.unavailable()
        if why is None:
            return JSONResponse({"status": "ready", "model": state.engine.model_name})
        return JSONResponse({"status": "unavailable", "error": why[:500]}, 503)
    failed = state.engine_error()
    if failed is not None:  # the engine died after loading: a supervisor should restart this process
        return JSONResponse({"status": "failed", "error": str(failed)[:500]}, 503)
    status = "failed" if state.load_error else "loading"
    return JSONResponse({"status": status, "error": state.load_error}, 503)


async def metrics(request: Request) -> Response:
    state = state_of(request)
    state.sample()
    assert state.metrics is not None
    body = await asyncio.to_thread(state.metrics.render)  # a few ms for many series: not on the event loop
    return Response(body, media_type=CONTENT_TYPE)
