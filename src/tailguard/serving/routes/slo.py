"""The SLO monitor's surfaces: ``GET /v1/alerts``, ``GET /slo/data`` and ``GET /slo/heatmap`` (admin key), the
``/slo`` page and the plotly.js it draws the region heatmap with (``GET /slo/plotly.js``)."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.serving.query import query_choice, query_int, query_number
from tailguard.serving.state import ServerState, state_of
from tailguard.slo.dashboard import DASHBOARD_HTML, json_safe
from tailguard.slo.region_heatmap import METRICS, heatmap_figure, region_heatmap, store_rows

ALERT_KINDS = ("alert", "action", "hook", "advisory", "objective")
TIER_NAMES = ("green", "yellow", "orange", "red")


async def alerts(request: Request) -> Response:
    """Alert, action, hook, advisory and objective records: the store's, plus any not yet written."""
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    limit = query_int(request, "limit", 100, 1, 10_000)
    since = query_number(request, "since", None, 0, 1e12)
    kind = query_choice(request, "kind", ALERT_KINDS)
    return JSONResponse(await asyncio.to_thread(_read_alerts, state, limit, since, kind))


def _read_alerts(state: ServerState, limit: int, since: float | None, kind: str | None) -> dict[str, Any]:
    mon = state.slo
    stored = state.store.alerts(limit, since, kind) if state.store is not None else []
    data = {(r["id"], r["event"], r["at"]): r for r in stored}
    if mon is not None:
        for r in mon.alerts(limit=None, kind=kind):
            if since is None or r["at"] >= since:
                data.setdefault((r["id"], r["event"], r["at"]), r)
    recs = sorted(data.values(), key=lambda r: r["at"])[-limit:]
    out: dict[str, Any] = {"object": "list", "enabled": mon is not None, "data": recs}
    if mon is not None:
        tier = mon.last.tier if mon.last is not None else 0
        out.update(tier=TIER_NAMES[tier], dry_run=mon.actions.dry_run, active=mon.alerts(active_only=True))
    return json_safe(out)


async def slo_page(request: Request) -> Response:
    """The page itself holds no data (it fetches ``/slo/data`` with the key from its URL fragment)."""
    if state_of(request).slo is None:
        raise APIError(404, "the SLO monitor is off (slo.enabled: false)", code="slo_disabled")
    return HTMLResponse(DASHBOARD_HTML, headers={"cache-control": "no-cache"})


async def slo_data(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))  # request IDs, lanes and regions
    if state.slo is None:
        raise APIError(404, "the SLO monitor is off (slo.enabled: false)", code="slo_disabled")
    snap = await asyncio.to_thread(state.slo.snapshot)
    return JSONResponse(json_safe(snap), headers={"cache-control": "no-store"})


# --- the region heatmap ----------------------------------------------------------------------------------------------
HEATMAP_BUCKET_S = 60.0
HEATMAP_TTL_S = 15.0  # the page asks every 30 s; several open pages share one reading of the store
HEATMAP_ROWS = 100_000  # the newest records of the span read at most
_heatmaps: dict[tuple[int, float, str, int], tuple[float, dict[str, Any]]] = {}
_heatmap_lock = threading.Lock()


async def slo_heatmap(request: Request) -> Response:
    """Region x minute over the monitor's window (``?minutes=`` for another span): the P99 of E2E (``?metric=ttft``
    for TTFT), the median RTT and the retransmit rate, from the store; with the plotly figure when plotly is
    installed."""
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))  # regions and their traffic
    if state.slo is None:
        raise APIError(404, "the SLO monitor is off (slo.enabled: false)", code="slo_disabled")
    if state.store is None:
        raise APIError(404, "the server has no request store", code="no_store")
    metric = query_choice(request, "metric", METRICS) or "e2e"
    window_min = max(1, round(state.slo.window_s / 60))
    minutes = query_int(request, "minutes", window_min, 1, 24 * 60)
    payload = await asyncio.to_thread(_heatmap, state, metric, minutes)
    return JSONResponse(payload, headers={"cache-control": "no-store"})


def _heatmap(state: ServerState, metric: str, minutes: int) -> dict[str, Any]:
    key = (id(state), state.started_unix, metric, minutes)  # the start time tells apart servers that reuse an id
    now = time.time()
    with _heatmap_lock:  # one reading at a time; the others take its result
        hit = _heatmaps.get(key)
        if hit is not None and now - hit[0] < HEATMAP_TTL_S:
            return hit[1]
        assert state.store is not None
        start = now - minutes * 60.0
        data = region_heatmap(store_rows(state.store, start, now, HEATMAP_ROWS), start=start, end=now,
                              bucket_s=HEATMAP_BUCKET_S, metric=metric)
        try:
            figure: Any = json.loads(heatmap_figure(data).to_json())
        except ImportError:  # plotly is the report extra: the page says so and shows the figures as a table
            figure = None
        payload = json_safe({"data": data, "figure": figure, "computed_at": now})
        if len(_heatmaps) > 32:
            _heatmaps.clear()
        _heatmaps[key] = (now, payload)
        return payload


@functools.cache
def _plotly_js() -> bytes | None:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return None
    return get_plotlyjs().encode()


async def plotly_js(request: Request) -> Response:
    """plotly.js from the installed plotly package, so that the page needs nothing outside this server."""
    body = await asyncio.to_thread(_plotly_js)
    if body is None:
        raise APIError(404, "plotly is not installed on the server (pip install 'tailguard[report]')",
                       code="plotly_missing")
    return Response(body, media_type="text/javascript; charset=utf-8",
                    headers={"cache-control": "public, max-age=86400"})
