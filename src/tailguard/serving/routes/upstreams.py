"""``/admin/upstreams``: the gateway's replica set, for people and for scale-out hooks (admin key only).

``GET`` lists the replicas with their health and load, where each came from (``source``: static or provider) and how
long it has been alive, the replica-seconds so far and, with a replica provider, what it runs; ``POST {"url": ...,
"max_concurrent": 64}`` adds one (checked before it takes traffic); ``DELETE /admin/upstreams/{name}`` takes one out
of routing (its requests in flight finish); one the provider started is drained first, then its process stopped.
"""

from __future__ import annotations

from typing import Any

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


def describe(state: ServerState) -> dict[str, Any]:
    pool = _pool(state)
    data = pool.describe()
    out: dict[str, Any] = {"object": "list", "data": data}
    ledger = state.ledger
    if ledger is not None and ledger.pool is pool:
        ledger.sync()
        for d, r in zip(data, pool.replicas, strict=False):
            d.update(ledger.entry(r))
        out["replica_seconds"] = ledger.summary()
    if state.provider is not None:
        out["provider"] = state.provider.summary()
    return out


async def list_upstreams(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    return JSONResponse(describe(state))


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
    if state.ledger is not None:
        state.ledger.sync()  # its replica-seconds count from now
    return JSONResponse(next(d for d in pool.describe() if d["name"] == rep.name), 201)


async def remove_upstream(request: Request) -> Response:
    state = state_of(request)
    state.keys.admin(request.headers.get("authorization"))
    pool = _pool(state)
    name = request.path_params["name"]
    provider = state.provider
    if provider is not None and any(p.name == name for p in provider.replicas()):
        return await _stop_provided(state, name)
    try:
        pool.remove(name)
    except KeyError:
        raise APIError(404, f"no replica named {name[:200]!r}", code="upstream_not_found") from None
    except ValueError as exc:
        raise APIError(409, str(exc), code="last_upstream") from None
    finally:
        if state.ledger is not None:
            state.ledger.sync()
    state.capacity_changed()
    return JSONResponse({"removed": name})


async def _stop_provided(state: ServerState, name: str) -> Response:
    """A replica the provider started: drained (its requests in flight finish), out of the pool, its process
    stopped; the answer says what that took."""
    assert state.provider is not None
    try:
        stop = await state.provider.stop_replica(name)
    except KeyError:
        raise APIError(404, f"no replica named {name[:200]!r}", code="upstream_not_found") from None
    except ValueError as exc:  # already being stopped, or the gateway's last replica
        raise APIError(409, str(exc), code="upstream_busy") from None
    finally:
        if state.ledger is not None:
            state.ledger.sync()
    return JSONResponse({"removed": name, "stopped": {
        "drained_requests": stop.drained, "cut_off_requests": stop.left, "drain_s": round(stop.drain_s, 3),
        "exit_status": stop.exit_status, "killed": stop.killed, "alive_s": round(stop.alive_s, 3)}})
