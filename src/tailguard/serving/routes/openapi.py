"""``GET /openapi.json``: the OpenAPI 3.1 document of the API as this server serves it (``serving/openapi.py``),
over the embedded engine or as a gateway. No key: it says nothing about the server that its routes don't."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from tailguard.serving.openapi import document_bytes
from tailguard.serving.state import state_of


async def openapi_json(request: Request) -> Response:
    app_state = request.app.state
    body: bytes | None = getattr(app_state, "openapi_document", None)
    if body is None:
        state = state_of(request)
        gateway = bool(state.config.upstreams) or state.upstream is not None
        body = await asyncio.to_thread(document_bytes, gateway)  # pydantic's schemas: some 25 ms, once
        if state.config.upstreams or state.ready:  # the mode is settled (a backend handed in is known once ready)
            app_state.openapi_document = body
    return Response(body, media_type="application/json")
