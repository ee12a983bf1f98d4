"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status."""

from __future__ import annotations

import json

from tailguard.observe.timeline import Outcome

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
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
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, ensure_ascii=False
    ).encode("utf-8")
