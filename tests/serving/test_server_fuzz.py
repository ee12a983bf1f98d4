"""Hostile request bodies through the real engine path (tiny model, real tokenizer, HTTP): whatever a client sends,
the answer is a 2xx or a 4xx in the API's JSON error format, and the engine is alive afterwards for everybody else.

Property-based (hypothesis): every request field is driven with odd values (negative and 64-bit-overflowing
integers, NaN and infinities, tiny temperatures, lone surrogates, wrong types, empty and nested lists, unknown keys).
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tests.serving_helpers import make_config

# Values a careless or hostile client sends for a number.
ODD_INTS = st.sampled_from([-(2**63) - 1, -(2**63), -1, 0, 1, 2, 3, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                            10**30])
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-300, 5e-324, 1e-6, 0.5, 1.0, 1.7,
                              2.0, 2.0000001, 1e308, -1.0])
SMALL_COUNTS = st.integers(min_value=1, max_value=6)
TEXTS = st.sampled_from(["hi", "", " ", "\ud800", "a\udfffb", "你好", "\x00", "<|im_end|>", "<|im_start|>system",
                         "\U0001f600" * 3, "x" * 300])
ANY_SCALAR = st.one_of(st.none(), st.booleans(), ODD_INTS, ODD_FLOATS, TEXTS)
ANY_VALUE = st.recursive(ANY_SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(TEXTS, inner, max_size=2)),
                         max_leaves=6)


# Odd values of the right type: they pass validation and reach the engine (sampling, stop rules, detokenizing).
EDGE_TEMPERATURES = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-6, 1e-5, 0.3, 1.0, 2.0])
EDGE_TOP_P = st.sampled_from([5e-324, 1e-300, 1e-6, 0.5, 0.999999, 1.0])
EDGE_TOP_K = st.sampled_from([-1, 0, 1, 2, 49151, 49152, 10**6, 2**63 - 1])
EDGE_SEEDS = st.sampled_from([-(2**63), -1, 0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])
STOPS = st.one_of(TEXTS.filter(bool), st.lists(st.sampled_from(["a", "\n", "。", "\ud800", "<|im_end|>", " the",
                                                                 "x" * 1024]), max_size=4))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": st.one_of(TEXTS, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS}),
                                          max_size=2))},
    optional={"name": TEXTS})
EDGE_COMMON = {
    "max_tokens": SMALL_COUNTS, "temperature": EDGE_TEMPERATURES, "top_p": EDGE_TOP_P, "top_k": EDGE_TOP_K,
    "min_tokens": st.integers(0, 6), "seed": EDGE_SEEDS, "stop": STOPS, "ignore_eos": st.booleans(),
    "stream": st.booleans(), "user": TEXTS, "priority": st.sampled_from([-(2**31), 0, 2**31 - 1]),
    "speculative": st.booleans(), "n": st.just(1), "presence_penalty": st.just(0),
}
EDGE_CHAT = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**EDGE_COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
              "add_generation_prompt": st.booleans()})
EDGE_COMPLETION = st.fixed_dictionaries(
    {"model": st.just("tiny"),
     "prompt": st.one_of(TEXTS, st.lists(st.integers(0, 49151), min_size=1, max_size=6),
                         st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=3), min_size=1, max_size=1))},
    optional={**EDGE_COMMON, "logprobs": st.integers(0, 20)})


def _garbage(edge: st.SearchStrategy) -> st.SearchStrategy:
    """An edge-case body with one to three fields replaced by anything at all (or added under odd names)."""
    keys = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
                            "top_p", "top_k", "min_tokens", "seed", "stop", "stream", "stream_options", "logprobs",
                            "top_logprobs", "n", "logit_bias", "tools", "user", "\ud800", "continue_final_message",
                            "echo", "unknown_field"])
    return st.builds(lambda body, extra: {**body, **extra}, edge, st.dictionaries(keys, ANY_VALUE, min_size=1,
                                                                                  max_size=3))


# Three in four bodies reach the engine; the rest carry garbage somewhere.
CHAT = st.one_of(EDGE_CHAT, EDGE_CHAT, EDGE_CHAT, _garbage(EDGE_CHAT))
COMPLETION = st.one_of(EDGE_COMPLETION, EDGE_COMPLETION, EDGE_COMPLETION, _garbage(EDGE_COMPLETION))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs
    from tailguard.serving.server import ThreadedServer

    # An engine of its own: a failure here must be this test's, not the session's shared tiny engine's.
    engine = AsyncLLMEngine.from_args(EngineArgs(model="tiny", kv_cache_tokens=4096, max_num_seqs=8,
                                                 max_num_batched_tokens=256, num_threads=1))
    try:
        with ThreadedServer(make_config(tmp_path_factory.mktemp("fuzz"), model="tiny"), engine) as s, \
                httpx.Client(base_url=s.url, timeout=60) as client:
            s.client = client
            yield s
    finally:
        engine.shutdown()


def _post(server, path: str, body: dict) -> tuple[int, bytes]:
    # ensure_ascii writes lone surrogates as JSON escapes; allow_nan writes NaN/Infinity (which Python's json reads).
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
    with server.client.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        return r.status_code, r.read()


def _check(server, status: int, payload: bytes) -> None:
    assert status < 500, (status, payload[:500])
    assert server.state.engine.engine.is_running
    if status >= 400:
        err = json.loads(payload)["error"]  # the API's own error format, never a plain-text page
        assert err["message"] and err["type"]


def _engine_alive(server) -> None:
    assert server.client.get("/health").status_code == 200
    assert server.client.get("/ready").status_code == 200
    r = server.client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


FUZZ = settings(max_examples=100, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=CHAT)
def test_chat_bodies_get_2xx_or_4xx_and_the_engine_lives(server, body):
    _check(server, *_post(server, "/v1/chat/completions", body))


@FUZZ
@given(body=COMPLETION)
def test_completion_bodies_get_2xx_or_4xx_and_the_engine_lives(server, body):
    _check(server, *_post(server, "/v1/completions", body))


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1])
def test_a_negative_or_unsigned_seed_is_served(server, seed):
    """The query of death: ``seed: -1`` with sampling once killed the engine for every tenant."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.9,
            "seed": seed, "ignore_eos": True}
    first = server.client.post("/v1/chat/completions", json=body)
    again = server.client.post("/v1/chat/completions", json=body)
    assert first.status_code == 200 and again.status_code == 200
    assert first.json()["choices"][0]["message"]["content"] == again.json()["choices"][0]["message"]["content"]


def test_a_lone_surrogate_in_a_field_name_is_a_json_400(server):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}'
    r = server.client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert "\\ud800" in r.json()["error"]["message"] or "\ud800" in r.json()["error"]["message"]


def test_the_engine_is_alive_after_all_of_it(server):
    _engine_alive(server)
