"""The per-token SSE chunk is built from byte templates, not from a schema: it must still be exactly the chunk the
OpenAI schema describes, for any text (quotes, control characters, Chinese, emoji) and any model name."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk

from tailguard.serving.responses import ChatFormat, CompletionFormat

TEXTS = ["Hello", " world", "", '"quoted" \\ back\\slash', "line\nbreak\ttab\r", "\x00\x01\x1f\x7f", "你好，世界",
         "😀 emoji", "</script>", "\u2028\u2029", "a" * 500]
MODELS = ["smollm2", 'odd "model" \\ name', "模型/v1"]


def _event(body: bytes) -> dict:
    """One SSE event: ``data: <one line of JSON>`` and a blank line."""
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    payload = body[len(b"data: "):-2]
    assert b"\n" not in payload  # an unescaped newline would split the event
    return json.loads(payload)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_chat_content_chunk_is_the_schema_chunk(text, model):
    fmt = ChatFormat("req-1", model, 1_700_000_000)
    got = _event(fmt.content(text))
    expected = {"id": "chatcmpl-req-1", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": model,
                "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}
    assert got == expected
    # The same bytes through the schema OpenAI's own client validates against, and back: nothing lost or added.
    chunk = ChatCompletionChunk.model_validate(got)
    assert chunk.choices[0].delta.content == text
    assert chunk.model_dump(exclude_unset=True) == expected


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("text", TEXTS)
def test_completion_content_chunk_is_the_schema_chunk(text, model):
    fmt = CompletionFormat("req-2", model, 1_700_000_001)
    got = _event(fmt.content(text))
    expected = {"id": "cmpl-req-2", "object": "text_completion", "created": 1_700_000_001, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    # (openai's ``Completion`` type, which its client reuses for stream chunks, cannot validate a chunk:
    # it requires a finish reason, and a chunk mid-stream has none yet.)
    assert got == expected


def test_fast_chunk_equals_the_general_builder():
    """The template path and the general ``json.dumps`` path (used for role, finish and usage chunks) agree."""
    fmt = ChatFormat("req-3", "smollm2", 1_700_000_002)
    for text in TEXTS:
        general = fmt._chunk([{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        assert _event(fmt.content(text)) == _event(general)
