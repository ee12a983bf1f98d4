"""``/admin/upstreams``: the gateway's replica set, for people and for scale-out hooks (admin key only).

``GET`` lists the replicas with their health and load; ``POST {"url": ..., "max_concurrent": 64}`` adds one (checked
before it takes traffic); ``DELETE /admin/upstreams/{name}`` takes one out of routing (its requests in flight finish).
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.backends.upstream.pool import UpstreamConfig, UpstreamForbidden, UpstreamPool
from tailguard.serving.protocol import decode_json
from tailguard.serving.state import ServerState, state_of


def _pool(state: ServerState) -> UpstreamPool:
    if state.upstream is None:
        raise APIError(404, "this server has no upstream replicas (it is not running as a gateway: --upstream)",
                       code="not_a_gateway")
    return state.upstream.pool


async def list_upstreams(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    return JSONResponse({"object": "list", "data": _pool(state).describe()})


async def add_upstream(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    pool = _pool(state)
    data = decode_json(await request.body())
    try:
        cfg = UpstreamConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_input=False, include_url=False)[0]
        raise APIError(400, f"bad upstream: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    try:
        rep = await pool.add(cfg)
    except UpstreamForbidden as exc:  # link-local, cloud metadata: never reached for whoever holds the admin key
        raise APIError(403, str(exc), code="upstream_forbidden") from None
    except ValueError as exc:
        raise APIError(409, str(exc), code="upstream_exists") from None
    state.capacity_changed()
    return JSONResponse(next(d for d in pool.describe() if d["name"] == rep.name), 201)


async def remove_upstream(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    pool = _pool(state)
    name = request.path_params["name"]
    try:
        pool.remove(name)
    except KeyError:
        raise APIError(404, f"no replica named {name[:200]!r}", code="upstream_not_found") from None
    except ValueError as exc:
        raise APIError(409, str(exc), code="last_upstream") from None
    state.capacity_changed()
    return JSONResponse({"removed": name})
