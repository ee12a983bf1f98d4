"""An OpenAI-style ``usage`` object as a peer reported it, with only the counts that can be true.

The gateway reads its upstreams' usage and the bench its endpoints'; both take a count only when it is an integer in
[0, MAX_USAGE_TOKENS] and count for themselves otherwise: a negative, fractional, string or 10^30 count once gave
negative throughput, crashed a run, or lost a record in the store."""

from __future__ import annotations

from typing import Any

# The most tokens a usage count may say (2**31: no request comes near it).
MAX_USAGE_TOKENS = 1 << 31
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def usage_count(value: Any) -> int | None:
    """A count that can be true, or None."""
    return value if type(value) is int and 0 <= value <= MAX_USAGE_TOKENS else None


def clean_usage(usage: Any) -> dict | None:
    """``usage`` without the counts that cannot be true (its other fields as they are); None if it is not an object."""
    if not isinstance(usage, dict):
        return None
    return {k: v for k, v in usage.items() if k not in USAGE_COUNTS or usage_count(v) is not None}
