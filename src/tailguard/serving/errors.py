"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status, and the
app's exception handlers that turn every failure into one."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from tailguard.api_error import APIError
from tailguard.observe.timeline import Outcome
from tailguard.serving.ids import REQUEST_ID

log = logging.getLogger("tailguard.server")

def outcome_of(err: APIError) -> Outcome:
    """How a refused request counts in the SLO: 429 and 503 rejected, other 4xx invalid, 5xx an error."""
    if err.status in (429, 503):
        return Outcome.REJECTED
    return Outcome.ERROR if err.status >= 500 else Outcome.INVALID


def error_response(err: APIError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=dict(err.headers))


async def on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in the OpenAI error format."""
    assert isinstance(exc, HTTPException)
    msg = "not found" if exc.status_code == 404 else str(exc.detail)
    return error_response(APIError(exc.status_code, f"{msg}: {request.method} {request.url.path[:200]}",
                                   code="not_found" if exc.status_code == 404 else None, headers=dict(exc.headers or {})))


async def on_server_error(request: Request, exc: Exception) -> Response:
    rid = request.headers.get("x-request-id", "")
    rid = rid if REQUEST_ID.match(rid) else ""  # a client's header: echo it only when it is a plain id
    log.error("unhandled error on %s %r", request.method, request.url.path[:200], exc_info=exc)
    return error_response(APIError(500, "internal server error" + (f"; request id {rid}" if rid else "")))
