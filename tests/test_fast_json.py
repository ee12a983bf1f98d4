"""orjson on the request path gives what the standard library gives, falling back to it where orjson refuses."""

from __future__ import annotations

import json
import math

import pytest

from tailguard import fast_json

_DOCS = [
    b'{"model": "m", "messages": [{"role": "user", "content": "h\\u00e9llo \\ud83d\\ude00"}], "max_tokens": 20}',
    b'{"a": "\\ud800 lone surrogate"}',  # json accepts it, orjson does not
    b'{"seed": 18446744073709551615, "big": 340282366920938463463374607431768211456}',  # beyond 64 bits
    b'{"t": NaN, "u": -Infinity}',  # not JSON, yet json takes it
    b'[1, 2.5, true, null, "x"]',
    '{"s": "caf\u00e9"}'.encode(),
]


@pytest.mark.parametrize("doc", _DOCS)
def test_loads_is_the_standard_librarys(doc: bytes) -> None:
    got, want = fast_json.loads(doc), json.loads(doc)
    if isinstance(want, dict) and any(isinstance(v, float) and math.isnan(v) for v in want.values()):
        assert math.isnan(got["t"]) and got["u"] == -math.inf
    else:
        assert got == want


@pytest.mark.parametrize("doc", [b"", b"{not json", b'{"a": 1', b"\xff\xfe"])
def test_what_is_not_json_raises_the_standard_librarys_error(doc: bytes) -> None:
    with pytest.raises(ValueError) as got:
        fast_json.loads(doc)
    with pytest.raises(ValueError) as want:
        json.loads(doc)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("obj", [
    {"model": "m", "messages": [{"role": "user", "content": "h\u00e9llo"}], "stream_options": {"include_usage": True}},
    {"a": "\ud800"},  # a lone surrogate that json.loads let in: orjson refuses to encode it
    {1: "int key"},
    {"seed": 2**64 + 1},
])
def test_dumps_round_trips_through_the_standard_library(obj: dict) -> None:
    out = fast_json.dumps(obj)
    assert isinstance(out, bytes)
    assert json.loads(out.decode("utf-8")) == json.loads(json.dumps(obj))
