"""The server on the real engine with the tiny random-weight model (real tokenizer): the openai client in both
modes and languages, logprobs, and a client that disconnects mid-stream, which must free its KV blocks."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tailguard.engine.fake import FakeTiming
from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path
from tests.serving_helpers import fake_server, make_config, open_stream, settle, tiny_engine, wait_until

PROMPTS = {"en": "Hello! Please introduce yourself in one sentence.", "zh": "你好！请用一句话介绍一下你自己。"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        resolve_model_path("smollm2")  # the tiny model borrows the real model's tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(f"model not available: {exc}")
    from tailguard.serving.server import ThreadedServer

    with ThreadedServer(make_config(tmp_path_factory.mktemp("tiny"), model="tiny"), tiny_engine()) as s:
        yield s


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_tiny_stream_equals_non_stream(server, lang):
    client = _client(server)
    msgs = [{"role": "user", "content": PROMPTS[lang]}]
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_tiny_async_concurrent_and_logprobs(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            async def one(lang):
                r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[lang]}],
                                                    max_tokens=6, temperature=0.8, seed=3, logprobs=True,
                                                    top_logprobs=3, extra_body={"ignore_eos": True})
                return r

            return await asyncio.gather(*(one(lang) for lang in ("en", "zh", "en", "zh")))

    results = asyncio.run(main())
    for r in results:
        content = r.choices[0].logprobs.content
        assert len(content) == 6
        for item in content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 3
            assert bytes(item.bytes)  # raw bytes even for a token that is half a character
            assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
    # Same seed and prompt: same sample.
    assert results[0].choices[0].message.content == results[2].choices[0].message.content


def test_disconnect_mid_stream_aborts_and_frees_kv_blocks(server):
    engine = server.state.engine
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0)
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS["zh"] * 4}], "max_tokens": 1500,
            "stream": True, "temperature": 0, "ignore_eos": True}
    sock = open_stream(server.url, body, "gone-1")
    received = b""
    while received.count(b"data: ") < 5:  # a few tokens in: the request holds KV blocks now
        received += sock.recv(65536)
    assert b"200 OK" in received
    assert engine.stats().kv_blocks_used > 0
    sock.close()
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0), engine.stats()
    settle(server)
    assert wait_until(lambda: server.state.store.get("gone-1") is not None, 5)
    rec = server.state.store.get("gone-1")
    assert rec["outcome"] == "aborted" and rec["status"] == 499
    assert 4 <= rec["output_tokens"] < 1500  # 5 events seen by the client: the role chunk and 4 tokens
    assert sum(rec["stages"].values()) == pytest.approx(rec["e2e"], abs=1e-3)


def test_disconnect_while_waiting_for_first_token_aborts(tmp_path):
    with fake_server(tmp_path, FakeTiming(ttft=30.0)) as s:
        sock = open_stream(s.url, {"model": "fake", "messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": 5, "stream": True}, "early-1")
        assert wait_until(lambda: s.state.admission.depth == 1, 10)
        sock.close()
        assert wait_until(lambda: "early-1" in s.state.engine.engine.aborted, 10)
        assert wait_until(lambda: s.state.admission.depth == 0 and s.state.admission.in_flight == 0, 10)
        settle(s)
        rec = s.state.store.get("early-1")
        assert rec["outcome"] == "aborted" and rec["output_tokens"] == 0
        assert rec["stages"]["queue"] > 0
