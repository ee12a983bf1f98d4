"""Several choices of one request (``n`` > 1) on the embedded engine, through the official ``openai`` client: each
choice is the answer a single request with seed ``seed + i`` gets, streamed choices carry their index, the usage
counts every choice, the prompt is computed once and shared through the prefix cache, and tools and logprobs work
per choice. On the tiny random-weight model: the mechanics, not the words."""

from __future__ import annotations

import httpx
import openai
import pytest

from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tests.serving_helpers import make_config, tiny_engine, wait_until

PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper and the sea. " * 8}]
KW = dict(model="tiny", messages=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.serving.server import ThreadedServer

    engine = tiny_engine()
    with ThreadedServer(make_config(tmp_path_factory.mktemp("choices"), model="tiny"), engine) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        yield client, engine, s.url


def test_each_choice_is_the_answer_its_seed_gives_alone(served):
    client, _, _ = served
    many = client.chat.completions.create(n=3, seed=41, **KW)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=41 + i, **KW).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == singles
    assert len(set(singles)) > 1, "different seeds should sample different answers at temperature 1"
    assert all(c.finish_reason == "length" for c in many.choices)
    assert many.usage.completion_tokens == 3 * 6
    assert many.usage.prompt_tokens == client.chat.completions.create(seed=1, **KW).usage.prompt_tokens


def test_streamed_choices_carry_their_index_and_match_the_whole_answer(served):
    client, _, _ = served
    whole = client.chat.completions.create(n=3, seed=7, **KW)
    texts = {0: "", 1: "", 2: ""}
    reasons: dict[int, str] = {}
    roles = set()
    usage = None
    for chunk in client.chat.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True},
                                                **KW):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0, 1, 2}, "each choice opens with its own role chunk"
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert usage is not None and usage.completion_tokens == 18


def test_completions_take_n_too(served):
    client, _, _ = served
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, n=2, seed=3,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    alone = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4, seed=4,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert r.choices[1].text == alone.choices[0].text
    assert r.usage.completion_tokens == 8


def test_the_prompt_is_computed_once_and_shared(served):
    client, engine, _ = served
    prompt = [{"role": "user", "content": f"A fresh prompt no other test sends, number {i}. " * 30}
              for i in range(1)]
    before = engine.stats()
    client.chat.completions.create(model="tiny", messages=prompt, max_tokens=3, n=4, seed=5,
                                   extra_body={"ignore_eos": True})
    after = engine.stats()
    prompt_tokens = client.chat.completions.create(model="tiny", messages=prompt, max_tokens=1).usage.prompt_tokens
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    full_blocks = prompt_tokens // 16 * 16
    # Choices 1-3 take every full block of the prompt from the cache that choice 0 filled.
    assert hits >= 3 * (full_blocks - 16), (hits, prompt_tokens)


def test_logprobs_and_tools_per_choice(served):
    client, _, _ = served
    r = client.chat.completions.create(n=2, seed=9, logprobs=True, top_logprobs=2, **KW)
    assert all(len(c.logprobs.content) == 6 for c in r.choices)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
    r = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=40, n=2, seed=2, tools=tools,
                                       tool_choice="required")
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls[0].function.name == "get_time"
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


@pytest.mark.parametrize("n", [0, 17, "2", 1.5])
def test_n_out_of_range_is_refused_by_name(served, n):
    _, _, url = served
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": PROMPT, "n": n}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


def test_a_client_gone_mid_stream_ends_every_choice(served):
    _, engine, url = served
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 2000, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        seen: set[int] = set()
        for line in r.iter_lines():
            if '"index":1' in line or '"index": 1' in line:
                seen.add(1)
            if '"index":0' in line or '"index": 0' in line:
                seen.add(0)
            if seen == {0, 1}:
                break
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0, timeout=20), \
        engine.stats()
