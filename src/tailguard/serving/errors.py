"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status, and the
app's exception handlers that turn every failure into one."""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from tailguard.observe.timeline import Outcome
from tailguard.serving.ids import REQUEST_ID

log = logging.getLogger("tailguard.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def outcome(self) -> Outcome:
        if self.status in (429, 503):
            return Outcome.REJECTED
        return Outcome.ERROR if self.status >= 500 else Outcome.INVALID

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}, ensure_ascii=False)
    # A message may quote the client's input, lone surrogates included (legal JSON escapes, not Unicode text):
    # written back as escapes, so that the error itself cannot fail to encode.
    return body.encode("utf-8", "backslashreplace")


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
                                   code="not_found" if exc.status_code == 404 else None, headers=exc.headers or {}))


async def on_server_error(request: Request, exc: Exception) -> Response:
    rid = request.headers.get("x-request-id", "")
    rid = rid if REQUEST_ID.match(rid) else ""  # a client's header: echo it only when it is a plain id
    log.error("unhandled error on %s %r", request.method, request.url.path[:200], exc_info=exc)
    return error_response(APIError(500, "internal server error" + (f"; request id {rid}" if rid else "")))
