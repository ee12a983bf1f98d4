"""The plain chat request's hand-checked path against the schema's, on generated requests."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tailguard.api_error import APIError
from tailguard.serving.protocol import _PLAIN_CHAT_KEYS, _parse_chat_schema, _plain_chat, parse_chat

# Each field's candidates: values the schema accepts, then values it refuses (wrong type, out of range, a bool for an
# int) or that the plain path leaves to it (``n``, ``seed``, ``user``, a developer message, content parts).
_VALUES: dict[str, tuple[list[Any], list[Any]]] = {
    "model": (["m", "fake", "x" * 512], ["", "x" * 513, 3, None, ["m"]]),
    "max_tokens": ([1, 20, None], [0, -1, 2**63, True, 1.0, "5"]),
    "max_completion_tokens": ([1, 7, None], [0, False, 2.5]),
    "stream": ([True, False, None], [1, "true"]),
    "stream_options": ([{"include_usage": True}, {"include_usage": False}, {}, None],
                       [{"include_usage": 1}, {"include_usage": None}, {"other": True}, [], True]),
    "temperature": ([0.0, 0.7, 2.0, None], [2.5, -0.1, float("nan"), float("inf"), 1, True, "0.5"]),
    "top_p": ([0.1, 1.0, None], [0.0, 1.5, 1, False]),
    "user": (["u", None], [5]),
    "n": ([1, 2, 16], [0, 17, True, 2.0, "2"]),
    "seed": ([3, None], ["3"]),
    "unknown_field": ([], [1]),
}
_MESSAGES: tuple[list[Any], list[Any]] = (
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}],
        [{"role": "assistant", "content": "x"}],
        [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}],
        [{"role": "user", "content": None}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
        [{"role": "user", "content": "hi", "name": "bob"}],
    ],
    [
        [{"role": "user", "content": "hi", "extra": 1}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": 5}],
        ["hi"],
        [],
        "hi",
        None,
    ],
)


def _outcome(fn: Any, data: dict[str, Any]) -> Any:
    try:
        return fn(data)
    except APIError as exc:
        return ("error", exc.status, exc.message, exc.param)


def _request(rng: random.Random) -> dict[str, Any]:
    """A request of good values, with one or two fields (the messages included) set to any candidate, good or bad:
    each bad value is tried in an otherwise plain request, where only the plain path's own check can refuse it."""
    fields = {"messages": _MESSAGES, **_VALUES}
    bad = set(rng.sample(sorted(fields), rng.choice((0, 1, 1, 2))))
    data: dict[str, Any] = {}
    for key, (good, refused) in fields.items():
        if key in bad:
            data[key] = rng.choice(good + refused)
        elif key in ("model", "messages") or key in _PLAIN_CHAT_KEYS and rng.random() < 0.4:
            data[key] = rng.choice(good)
    return data


def test_the_plain_path_returns_what_the_schema_returns_whenever_it_answers() -> None:
    rng = random.Random(7)
    answered = refused_by_schema = 0
    for _ in range(6000):
        data = _request(rng)
        plain = _plain_chat(data)
        schema = _outcome(_parse_chat_schema, data)
        if plain is not None:
            answered += 1
            assert schema == plain, data  # never accepts what the schema refuses, never parses differently
        elif isinstance(schema, tuple):
            refused_by_schema += 1
        assert _outcome(parse_chat, data) == schema, data
    # Both sides are exercised: the generator makes plain requests and ones the schema must judge.
    assert answered > 300 and refused_by_schema > 1000, (answered, refused_by_schema)


@pytest.mark.parametrize("data", [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True},
    {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
     "max_completion_tokens": 5, "max_tokens": 9, "temperature": 0.2, "top_p": 0.9, "stream": True,
     "stream_options": {"include_usage": True}},
])
def test_common_requests_take_the_plain_path(data: dict[str, Any]) -> None:
    parsed = _plain_chat(data)
    assert parsed is not None
    assert parsed == _parse_chat_schema(data)
    assert parsed.max_tokens == data.get("max_completion_tokens", data.get("max_tokens"))
