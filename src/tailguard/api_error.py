"""The API's own error, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP
status and headers (``Retry-After``). Raised on every floor that refuses a request for the client to read (identity,
parsing, the server's routes); the server's handlers turn it into the response (serving/errors.py)."""

from __future__ import annotations

import json

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

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}, ensure_ascii=False)
    # A message may quote the client's input, lone surrogates included (legal JSON escapes, not Unicode text):
    # written back as escapes, so that the error itself cannot fail to encode.
    return body.encode("utf-8", "backslashreplace")
