"""The ASGI application: routes, OpenAI-shaped errors, and a lifespan that loads the engine and runs the sampler.

The model loads in a background thread after the server starts, so ``/health`` answers at once and ``/ready`` says
when requests can be served (what a load balancer or Kubernetes probe expects).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from tailguard.observe.metrics import CONTENT_TYPE, ServerMetrics
from tailguard.observe.store import RequestStore
from tailguard.serving.backend import Backend
from tailguard.serving.completions import REQUEST_ID, CompletionEndpoint
from tailguard.serving.config import ServerConfig
from tailguard.serving.errors import APIError
from tailguard.serving.state import ServerState
from tailguard.slo.dashboard import DASHBOARD_HTML, json_safe

log = logging.getLogger("tailguard.server")


def _error(err: APIError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=dict(err.headers))


def create_app(
    config: ServerConfig,
    engine: Backend | None = None,
    engine_factory: Callable[[], Backend] | None = None,
    redactor: Any | None = None,
    own_engine: bool | None = None,
    slo_clock: Callable[[], float] | None = None,
) -> Starlette:
    """Build the app. Give a ready ``engine`` (tests, embedding) or an ``engine_factory`` to load in the background.

    ``slo_clock``: the SLO monitor's clock (unix seconds; tests pass a fake one and call ``state.slo.evaluate()``).
    """
    if engine is None and engine_factory is None:
        raise ValueError("create_app needs an engine or an engine_factory")
    own = own_engine if own_engine is not None else engine is None
    state = ServerState(config)
    state.metrics = ServerMetrics(config.model, config.business_types)
    if config.slo.enabled:
        from tailguard.slo.monitor import SLOMonitor

        def to_store(record: dict[str, Any]) -> None:
            if state.store is not None:
                state.store.put_alert(record)

        # Same registry as the request metrics: one /metrics scrape carries the alerts and actions too.
        state.slo = SLOMonitor(config.slo, sinks=[to_store], registry=state.metrics.registry,
                               clock=slo_clock or time.time)

    def encode(text: str) -> list[int]:
        return state.engine.tokenizer.encode(text) if state.engine is not None else []

    async def sampler() -> None:
        tick = 0
        while True:
            try:
                state.sample()
                if tick % 2 == 0:
                    state.store_sample()
            except Exception:  # noqa: BLE001 - a failed sample must not stop sampling
                log.exception("sampler")
            tick += 1
            await asyncio.sleep(config.sample_interval)

    def attach(eng: Backend) -> None:
        state.attach(eng)
        state.metrics.model = eng.model_name

    async def load() -> None:
        try:
            eng = await asyncio.to_thread(engine_factory)
        except Exception as exc:  # noqa: BLE001 - reported by /ready and every request
            log.exception("the model failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"
            return
        attach(eng)
        state.ready = state.store is not None

    @asynccontextmanager
    async def lifespan(app: Starlette):
        red = redactor
        if config.store_text and red is None:
            from tailguard.observe.redaction import Redactor

            red = await asyncio.to_thread(Redactor)  # imports Presidio: seconds, off the event loop
        state.store = await asyncio.to_thread(
            RequestStore, config.store_path, retention_days=config.retention_days, store_text=config.store_text,
            redact=red.redact if red is not None else None, encode=encode,
            on_error=lambda n: state.metrics.store_errors.labels(state.metrics.model).inc(n),
            on_drop=lambda n: state.metrics.store_dropped.labels(state.metrics.model).inc(n),
        )
        loader = None
        if engine is not None:
            attach(engine)
            state.ready = True
        else:
            loader = asyncio.create_task(load())
        sampling = asyncio.create_task(sampler())
        evaluating = asyncio.create_task(state.slo.run()) if state.slo is not None else None
        app.state.tailguard = state
        try:
            yield
        finally:
            sampling.cancel()
            if evaluating is not None:
                evaluating.cancel()
            if loader is not None:
                loader.cancel()
            state.ready = False
            if own and state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown)
            if state.slo is not None:
                await asyncio.to_thread(state.slo.close)  # waits (bounded) for scale-hook calls in flight
            await asyncio.to_thread(state.store.close)

    def guard(request: Request) -> None:
        if not state.authorized(request.headers.get("authorization")):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def models(request: Request) -> Response:
        guard(request)
        return JSONResponse({"object": "list", "data": [_model_card(state, n) for n in state.model_names]})

    async def model_one(request: Request) -> Response:
        guard(request)
        name = request.path_params["model"]
        if name not in state.model_names:
            raise APIError(404, f"The model `{name[:200]}` does not exist", param="model", code="model_not_found")
        return JSONResponse(_model_card(state, name))

    async def health(request: Request) -> Response:
        failed = getattr(state.engine, "error", None) if state.engine is not None else None
        if failed is not None or state.load_error:
            return JSONResponse({"status": "failed", "error": str(failed or state.load_error)[:500]}, 503)
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if state.ready and state.engine is not None and getattr(state.engine, "error", None) is None:
            return JSONResponse({"status": "ready", "model": state.engine.model_name})
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, 503)

    async def metrics(request: Request) -> Response:
        state.sample()
        body = await asyncio.to_thread(state.metrics.render)  # a few ms for many series: not on the event loop
        return Response(body, media_type=CONTENT_TYPE)

    async def get_request(request: Request) -> Response:
        guard(request)
        rid = request.path_params["request_id"]
        rec = None
        if state.store is not None:
            rec = await asyncio.to_thread(state.store.get, rid)
        recent = state.recent.get(rid)
        # A client may reuse an ID: the in-memory record is the latest one; use it until the store has caught up.
        if recent is not None and (rec is None or rec.get("received_at") != recent.received_unix):
            rec = recent.to_record()  # not yet written by the batch writer (and never with text)
        if rec is None:
            raise APIError(404, f"no record of request {rid[:128]!r} (records are kept "
                                f"{config.retention_days:g} days)", code="request_not_found")
        return JSONResponse(rec)

    def _query_number(request: Request, name: str, default: float | None, lo: float, hi: float) -> float | None:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not (lo <= v <= hi):
            raise APIError(400, f"query parameter {name!r} must be a number from {lo:g} to {hi:g}, got {raw[:50]!r}",
                           param=name, code="invalid_value")
        return v

    def _query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(hi)) and lo <= int(raw) <= hi):
            raise APIError(400, f"query parameter {name!r} must be a whole number from {lo} to {hi}, got "
                                f"{raw[:50]!r}", param=name, code="invalid_value")
        return int(raw)

    async def alerts(request: Request) -> Response:
        """Alert, action, hook, advisory and objective records: the store's, plus any not yet written."""
        guard(request)
        limit = _query_int(request, "limit", 100, 1, 10_000)
        since = _query_number(request, "since", None, 0, 1e12)
        kind = request.query_params.get("kind")
        kinds = ("alert", "action", "hook", "advisory", "objective")
        if kind is not None and kind not in kinds:
            raise APIError(400, f"query parameter 'kind' must be one of {', '.join(kinds)}", param="kind",
                           code="invalid_value")
        mon = state.slo

        def read() -> dict[str, Any]:
            stored = state.store.alerts(limit, since, kind) if state.store is not None else []
            data = {(r["id"], r["event"], r["at"]): r for r in stored}
            if mon is not None:
                for r in mon.alerts(limit=None, kind=kind):
                    if since is None or r["at"] >= since:
                        data.setdefault((r["id"], r["event"], r["at"]), r)
            recs = sorted(data.values(), key=lambda r: r["at"])[-limit:]
            out: dict[str, Any] = {"object": "list", "enabled": mon is not None, "data": recs}
            if mon is not None:
                snap_tier = mon.last.tier if mon.last is not None else 0
                out.update(tier=("green", "yellow", "orange", "red")[snap_tier], dry_run=mon.actions.dry_run,
                           active=mon.alerts(active_only=True))
            return json_safe(out)

        return JSONResponse(await asyncio.to_thread(read))

    async def slo_page(request: Request) -> Response:
        if state.slo is None:
            raise APIError(404, "the SLO monitor is off (slo.enabled: false)", code="slo_disabled")
        return HTMLResponse(DASHBOARD_HTML, headers={"cache-control": "no-cache"})

    async def slo_data(request: Request) -> Response:
        guard(request)  # request IDs, lanes and regions: behind the API key like /v1/alerts
        if state.slo is None:
            raise APIError(404, "the SLO monitor is off (slo.enabled: false)", code="slo_disabled")
        snap = await asyncio.to_thread(state.slo.snapshot)
        return JSONResponse(json_safe(snap), headers={"cache-control": "no-store"})

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return _error(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        msg = "not found" if exc.status_code == 404 else str(exc.detail)
        return _error(APIError(exc.status_code, f"{msg}: {request.method} {request.url.path[:200]}",
                               code="not_found" if exc.status_code == 404 else None, headers=exc.headers or {}))

    async def server_error(request: Request, exc: Exception) -> Response:
        rid = request.headers.get("x-request-id", "")
        rid = rid if REQUEST_ID.match(rid) else ""  # a client's header: echo it only when it is a plain id
        log.error("unhandled error on %s %r", request.method, request.url.path[:200], exc_info=exc)
        return _error(APIError(500, "internal server error" + (f"; request id {rid}" if rid else "")))

    routes = [
        Route("/v1/chat/completions", CompletionEndpoint(state, chat=True), methods=["POST"]),
        Route("/v1/completions", CompletionEndpoint(state, chat=False), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_one, methods=["GET"]),
        Route("/v1/requests/{request_id:path}", get_request, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/alerts", alerts, methods=["GET"]),
        Route("/slo", slo_page, methods=["GET"]),
        Route("/slo/data", slo_data, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
    )
    app.state.tailguard = state
    return app


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    eng = state.engine
    return {"id": name, "object": "model", "created": int(state.started_unix), "owned_by": "tailguard",
            "root": eng.model_name if eng is not None else name,
            "max_model_len": eng.max_model_len if eng is not None else None}
