"""Query-string parameters checked against a range, with an OpenAI-shaped 400 when they are not."""

from __future__ import annotations

import math

from starlette.requests import Request

from tailguard.api_error import APIError


def query_number(request: Request, name: str, default: float | None, lo: float, hi: float) -> float | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (lo <= v <= hi):
        raise APIError(400, f"query parameter {name!r} must be a number from {lo:g} to {hi:g}, got {raw[:50]!r}",
                       param=name, code="invalid_value")
    return v


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(hi)) and lo <= int(raw) <= hi):
        raise APIError(400, f"query parameter {name!r} must be a whole number from {lo} to {hi}, got "
                            f"{raw[:50]!r}", param=name, code="invalid_value")
    return int(raw)


def query_choice(request: Request, name: str, choices: tuple[str, ...]) -> str | None:
    raw = request.query_params.get(name)
    if raw is not None and raw not in choices:
        raise APIError(400, f"query parameter {name!r} must be one of {', '.join(choices)}", param=name,
                       code="invalid_value")
    return raw
