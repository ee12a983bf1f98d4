"""``GET /v1/requests/{id}``: one request's record. The admin key reads any; a client key only the ones it made."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.observe.store import unstored_record
from tailguard.observe.timeline import Timeline
from tailguard.policy.identity import Caller
from tailguard.serving.state import ServerState, state_of


async def get_request(request: Request) -> Response:
    state = state_of(request)
    caller = state.keys.owner(request.headers.get("authorization"))
    rid = request.path_params["request_id"]
    try:
        rec = await asyncio.to_thread(_stored, state, rid, caller)
    except (OSError, ConnectionError) as exc:  # the store cannot be read right now
        raise APIError(503, f"the request store is unavailable: {type(exc).__name__}", code="store_unavailable",
                       headers={"Retry-After": "5"}) from None
    except Exception as exc:
        if type(exc).__module__.startswith("psycopg"):  # OperationalError while PostgreSQL restarts
            raise APIError(503, "the request store is unavailable right now", code="store_unavailable",
                           headers={"Retry-After": "5"}) from None
        raise
    recent = _recent(state, rid, caller)
    # A client may reuse an ID: the in-memory record is the latest one; use it until the store has caught up.
    if recent is not None and (rec is None or rec.get("received_at") != recent.received_unix):
        # Not yet written by the batch writer: shown as the store will show it (never with text or the raw user).
        rec = state.store.record_of(recent) if state.store is not None else unstored_record(recent)
    if rec is None:
        # Also what a client gets for another client's record: whether it exists is not its business.
        raise APIError(404, f"no record of request {rid[:128]!r} (records are kept "
                            f"{state.config.retention_days:g} days)", code="request_not_found")
    return JSONResponse(rec)


def _recent(state: ServerState, rid: str, caller: Caller) -> Timeline | None:
    """The caller's newest record with this id that the store may not have written yet (the admin: anyone's)."""
    if not caller.admin:
        return state.recent.get((rid, caller.key_id)) if caller.key_id is not None else None
    owned = [tl for (r, _), tl in state.recent.items() if r == rid]
    return max(owned, key=lambda tl: tl.received_unix, default=None)


def _stored(state: ServerState, rid: str, caller: Caller) -> dict[str, Any] | None:
    """The caller's most recent stored record with this id (client IDs may repeat, across clients too)."""
    if state.store is None:
        return None
    if caller.admin:
        return state.store.get(rid)
    if caller.key_id is None:
        return None
    return state.store.get_owned(rid, caller.key_id)
