"""The server on the real SmolLM2-135M-Instruct model with the official openai client."""

from __future__ import annotations

import openai
import pytest

from tests.serving_helpers import make_config

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tailguard.engine.model_store import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 not available: {exc}")
    from tailguard.engine.engine import AsyncLLMEngine, EngineArgs
    from tailguard.serving.server import ThreadedServer

    engine = AsyncLLMEngine.from_args(EngineArgs(model="smollm2", kv_cache_tokens=4096, max_num_seqs=8,
                                                 max_num_batched_tokens=256, max_prefill_chunk=128))
    try:
        with ThreadedServer(make_config(tmp_path_factory.mktemp("real"), model="smollm2"), engine) as s:
            yield s
    finally:
        engine.shutdown()


@pytest.mark.parametrize("prompt,expect", [("What is the capital of France? Answer in one word.", "paris"),
                                           ("法国的首都是哪里？", None)])
def test_real_model_chat_stream_and_non_stream(server, prompt, expect):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert text.strip()
    assert "\ufffd" not in text
    if expect:
        assert expect in text.lower()
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    tg = chunks[-1].model_extra["tailguard"]
    assert tg["ttft"] > 0 and tg["stages"]["prefill"] > 0 and tg["output_tokens"] == full.usage.completion_tokens
