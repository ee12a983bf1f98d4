"""Request IDs: the client's ``X-Request-ID`` when it is a plain id, else one of ours."""

from __future__ import annotations

import re
import secrets

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@\-]{1,128}$")


def new_request_id() -> str:
    return secrets.token_hex(12)


def request_id_from(header: str | None) -> str:
    return header if header and REQUEST_ID.match(header) else new_request_id()
