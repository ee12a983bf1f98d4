"""``GET /v1/models`` and ``GET /v1/models/{model}``: the names clients may send, behind the client key."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tailguard.api_error import APIError
from tailguard.serving.state import ServerState, state_of


async def list_models(request: Request) -> Response:
    state = state_of(request)
    state.keys.client(request.headers.get("authorization"))
    return JSONResponse({"object": "list", "data": [model_card(state, n) for n in state.model_names]})


async def get_model(request: Request) -> Response:
    state = state_of(request)
    state.keys.client(request.headers.get("authorization"))
    name = request.path_params["model"]
    if name not in state.model_names:
        raise APIError(404, f"The model `{name[:200]}` does not exist", param="model", code="model_not_found")
    return JSONResponse(model_card(state, name))


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    eng = state.engine
    return {"id": name, "object": "model", "created": int(state.started_unix), "owned_by": "tailguard",
            "root": eng.model_name if eng is not None else name,
            "max_model_len": eng.max_model_len if eng is not None else None}
