"""The SLO monitor's surfaces: ``GET /v1/alerts`` and ``GET /slo/data`` (admin key), and the ``/slo`` page."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.serving.query import query_choice, query_int, query_number
from tailguard.serving.state import ServerState, state_of
from tailguard.slo.dashboard import DASHBOARD_HTML, json_safe

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
