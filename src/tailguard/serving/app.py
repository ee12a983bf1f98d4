"""The ASGI application: the routing table, the exception handlers and the lifespan, put together.

Each endpoint lives in its own module (``serving/routes/*``, ``serving/endpoint.py``) and finds the server's state
on ``request.app.state.tailguard``; ``serving/lifespan.py`` starts and stops what runs beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Route

from tailguard.backends.base import Backend
from tailguard.backends.local import LocalEngine
from tailguard.observe.metrics import ServerMetrics
from tailguard.serving.config import ServerConfig
from tailguard.serving.endpoint import CompletionEndpoint
from tailguard.serving.errors import APIError, on_api_error, on_http_error, on_server_error
from tailguard.serving.forward import ForwardEndpoint
from tailguard.serving.lifespan import Lifespan
from tailguard.serving.routes import health, models, openapi, records, slo, tokenizer, upstreams
from tailguard.serving.state import ServerState
from tailguard.serving.tokenize_pipeline import with_pipeline

if TYPE_CHECKING:
    from tailguard.slo.monitor import SLOMonitor


def create_app(
    config: ServerConfig,
    engine: Backend | LocalEngine | None = None,
    engine_factory: Callable[[], Backend | LocalEngine] | None = None,
    redactor: Any | None = None,
    own_engine: bool | None = None,
    slo_clock: Callable[[], float] | None = None,
    own_process: bool = False,
) -> Starlette:
    """Build the app. Give a ready ``engine`` (tests, embedding) or an ``engine_factory`` to load in the background.

    ``own_process``: the process runs this server and nothing else (``tailguard serve``), so process-wide settings
    (the garbage collector's schedule, serving/gc_schedule.py) are the server's to make.

    ``slo_clock``: the SLO monitor's clock (unix seconds; tests pass a fake one and call ``state.slo.evaluate()``).
    """
    if engine is None and engine_factory is None:
        raise ValueError("create_app needs an engine or an engine_factory")
    state = ServerState(config)
    state.metrics = ServerMetrics(config.model, config.business_types)
    if config.slo.enabled:
        state.slo = _slo_monitor(state, slo_clock or time.time)
        state.metrics.reserve(named_business_types(state.slo.config, state.slo.profiles))
    own = own_engine if own_engine is not None else engine is None
    routes = [
        Route("/v1/chat/completions", CompletionEndpoint(state, chat=True), methods=["POST"]),
        Route("/v1/completions", CompletionEndpoint(state, chat=False), methods=["POST"]),
        Route("/v1/responses", ForwardEndpoint(state, "/v1/responses"), methods=["POST"]),
        Route("/v1/embeddings", ForwardEndpoint(state, "/v1/embeddings"), methods=["POST"]),
        Route("/v1/models", models.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", models.get_model, methods=["GET"]),
        Route("/v1/requests/{request_id:path}", records.get_request, methods=["GET"]),
        Route("/health", health.health, methods=["GET"]),
        Route("/openapi.json", openapi.openapi_json, methods=["GET"]),
        Route("/ready", health.ready, methods=["GET"]),
        Route("/metrics", health.metrics, methods=["GET"]),
        Route("/v1/alerts", slo.alerts, methods=["GET"]),
        Route("/slo", slo.slo_page, methods=["GET"]),
        Route("/slo/data", slo.slo_data, methods=["GET"]),
        Route("/slo/heatmap", slo.slo_heatmap, methods=["GET"]),
        Route("/slo/plotly.js", slo.plotly_js, methods=["GET"]),
        Route("/admin/upstreams", upstreams.list_upstreams, methods=["GET"]),
        Route("/admin/upstreams", upstreams.add_upstream, methods=["POST"]),
        Route("/admin/upstreams/{name:path}", upstreams.remove_upstream, methods=["DELETE"]),
        Route("/admin/tokenizer/glossary", tokenizer.glossary, methods=["GET"]),
        Route("/admin/tokenizer/glossary", tokenizer.reload_glossary, methods=["POST"]),
    ]
    middleware = []
    if config.tracing.enabled:  # W3C trace context in and out; without tracing, nothing is in the request's path
        from starlette.middleware import Middleware

        try:
            from tailguard.observe.tracing import TraceContextMiddleware
        except ImportError as exc:
            raise RuntimeError(f"tracing.otlp_endpoint is set, but OpenTelemetry is not installed ({exc}): "
                               "pip install 'tailguard[server]'") from exc

        middleware.append(Middleware(TraceContextMiddleware, state=state))
    app = _App(
        routes=routes,
        middleware=middleware,
        # The tokenize pipeline's glossary loads once the backend is attached, and stops before it closes.
        lifespan=with_pipeline(Lifespan(state, engine, engine_factory, redactor, own, own_process), state),
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_server_error},
    )
    app.state.tailguard = state
    # No 307 to the path with(out) its trailing slash: Starlette builds that redirect from the client's Host header
    # (GET /v1/requests sent a client on to wherever its Host said); a path that is not a route is a 404.
    app.router.redirect_slashes = False
    if not middleware:  # a middleware of ours (tracing) must see every request: then Starlette routes them all
        app.hot = {r.path: r.endpoint for r in routes[:2]}
    return app


class _App(Starlette):
    """Starlette, with the two completion endpoints called straight from the server: they catch every error
    themselves and answer in OpenAI's format, so Starlette's error middleware, exception middleware and router, and
    their wrappers around each of a stream's sends, were pure cost on the gateway's per-request path (~5% of its
    CPU at 256 streams). Anything else, and these paths with any other method, go through Starlette as before."""

    hot: dict[str, Any] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.hot.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def named_business_types(*configs: Any) -> set[str]:
    """Every business type named in these pydantic models (any field ending in ``business_types``: profiles' and
    objectives' selectors, scopes, shedding), at any depth."""
    from pydantic import BaseModel

    names: set[str] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, BaseModel):
            for field, value in obj:
                if field.endswith("business_types") and isinstance(value, list | tuple):
                    names.update(str(v) for v in value)
                else:
                    walk(value)
        elif isinstance(obj, list | tuple):
            for item in obj:
                walk(item)

    walk(configs)
    return names


def _slo_monitor(state: ServerState, clock: Callable[[], float]) -> SLOMonitor:
    from tailguard.slo.monitor import SLOMonitor

    def to_store(record: dict[str, Any]) -> None:
        if state.store is not None:
            state.store.put_alert(record)

    # Same registry as the request metrics: one /metrics scrape carries the alerts and actions too.
    assert state.metrics is not None
    return SLOMonitor(state.config.slo, sinks=[to_store], registry=state.metrics.registry, clock=clock)
