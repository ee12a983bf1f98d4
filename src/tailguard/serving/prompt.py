"""Reading a completion request: the body (bounded before it is read), its JSON parsed and checked, and the prompt
sized and tokenized for a backend that takes token ids. Oversized prompts are refused as early as each check can
tell: by the body's Content-Length, by the prompt's characters, by a floor on its tokens, by its head's tokens."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect

from tailguard.api_error import APIError
from tailguard.backends.base import Backend, Tokenizer
from tailguard.serving.chat_prompt import render_chat_prompt
from tailguard.serving.exchange import Incoming
from tailguard.serving.protocol import Parsed
from tailguard.serving.state import ServerState
from tailguard.serving.tokenize_pipeline import encode_error, pipeline_of

# Room in a body for what is not the prompt (the other fields, the messages' JSON framing).
_BODY_OVERHEAD_BYTES = 64 * 1024


def prompt_char_limit(engine: Backend) -> int | None:
    """The most characters a prompt that fits the context window can have (None: the backend does not tokenize)."""
    tok = engine.tokenizer
    if tok is None:
        return None
    return engine.max_model_len * tok.max_token_chars


def _prompt_chars(p: Parsed) -> int:
    if p.messages is not None:
        return sum(len(m["content"]) + len(m["role"]) for m in p.messages)
    return len(p.prompt or "")


# A prompt longer than this many characters a token of the context window is first tokenized in part: its head
# alone, cut at a space, shows most oversized prompts for what they are at a bounded cost.
_HEAD_CHARS_PER_TOKEN = 4


def _head_too_long(tok: Tokenizer, text: str, max_model_len: int) -> int | None:
    """The context window (to name in the error) when the head of ``text`` alone has more tokens than it; else None.

    Cut just before a space that precedes a word, the head's tokens are exactly the first tokens of the whole text
    (byte-level BPE never merges across that boundary), so a head over the limit proves the whole is over it. Text
    with no space near the cut (Chinese, a run of symbols) is not probed: the whole is tokenized."""
    probe = _HEAD_CHARS_PER_TOKEN * max_model_len
    if len(text) <= 2 * probe:
        return None
    cut = text.rfind(" ", probe // 2, probe)
    if cut <= 0 or text[cut + 1:cut + 2].isspace() or text[cut - 1].isspace():
        return None
    return max_model_len if len(tok.encode(text[:cut])) > max_model_len else None


def prompt_text(p: Parsed) -> str:
    if p.messages is not None:
        return "\n".join(str(m.get("content") or "") for m in p.messages)
    return p.prompt or ""


class PromptReader:
    """Reads, sizes and tokenizes the prompts of one endpoint (``chat``: /v1/chat/completions)."""

    def __init__(self, state: ServerState, chat: bool) -> None:
        self.state = state
        self.chat = chat

    def body_limit(self, engine: Backend) -> int:
        """The most bytes a body may have: the configured limit, and below it the most a prompt that fits the
        context window can take as JSON (every character as a 12-byte surrogate-pair escape), so that an oversized
        body is refused from its Content-Length, before it is read, parsed or tokenized."""
        limit = self.state.config.max_body_bytes
        chars = prompt_char_limit(engine)
        return limit if chars is None else min(limit, chars * 12 + _BODY_OVERHEAD_BYTES)

    async def read_body(self, request: Incoming, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes")
        chunks, size = [], 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes")
            chunks.append(part)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def check_prompt_size(self, engine: Backend, p: Parsed) -> None:
        """Refuse a prompt too long for the context window by its characters alone, before it costs a tokenize."""
        limit = prompt_char_limit(engine)
        size = _prompt_chars(p)
        where = "messages" if self.chat else "prompt"
        if limit is not None and size > limit:
            raise APIError(400, f"the prompt has {size:,} characters: more than the {engine.max_model_len:,}-token "
                                f"context window can hold (at most {limit:,} characters at "
                                f"{limit // engine.max_model_len} characters a token)",
                           param=where, code="context_length_exceeded")
        tok = engine.tokenizer
        if tok is None or size <= self.state.config.tokenize_in_thread_chars:
            return  # short: tokenizing it costs less than looking
        text = "".join(m["content"] for m in p.messages) if p.messages is not None else (p.prompt or "")
        floor = tok.min_tokens(text)
        if floor >= engine.max_model_len:
            raise APIError(400, f"the prompt has at least {floor:,} tokens; this model's context window is "
                                f"{engine.max_model_len:,} tokens", param=where, code="context_length_exceeded")

    async def tokenize(self, engine: Backend, p: Parsed) -> tuple[list[int], str | None]:
        tok = engine.tokenizer
        assert tok is not None, "only a backend that takes token ids has its prompts tokenized here"

        def render() -> str:
            if p.messages is None:
                text = p.prompt or ""
            else:
                text = render_chat_prompt(tok, p.messages, p.add_generation_prompt, p.continue_final_message)
            too_long = _head_too_long(tok, text, engine.max_model_len)
            if too_long is not None:
                raise APIError(400, f"the prompt has more than {too_long:,} tokens in its first "
                                    f"{_HEAD_CHARS_PER_TOKEN * engine.max_model_len:,} characters alone; this "
                                    f"model's context window is {engine.max_model_len:,} tokens",
                               param="messages" if self.chat else "prompt", code="context_length_exceeded")
            return text

        def run() -> tuple[list[int], str]:
            text = render()
            try:
                return tok.encode(text), text
            except Exception as exc:  # noqa: BLE001 - reworded below
                raise encode_error(text, exc) from None

        if p.prompt_token_ids is not None:
            return p.prompt_token_ids, None
        try:
            if _prompt_chars(p) > self.state.config.tokenize_in_thread_chars:
                # Off the event loop (the tokenizer lets go of the GIL for long texts), one long prompt at a time:
                # however many huge prompts arrive, they queue for one core and leave the rest to everybody else.
                async with self.state.long_tokenize:
                    return await asyncio.to_thread(run)
            # The template on the loop (short); the encode through the cache, then batched with the prompts that
            # arrive with this one, on the batcher's thread (serving/tokenize_pipeline.py).
            text = render()
            return await pipeline_of(self.state).encode(tok, text), text
        except APIError:
            raise
        except UnicodeEncodeError as exc:  # a lone surrogate: a legal JSON escape, but not Unicode text
            bad = exc.object[exc.start:exc.end].encode("unicode_escape").decode()[:40]
            raise APIError(400, f"the prompt is not valid Unicode text: it holds the lone surrogate {bad}",
                           param="messages" if self.chat else "prompt") from None
        except Exception as exc:  # noqa: BLE001 - whatever the template or tokenizer rejects is the input's fault
            raise APIError(400, f"the prompt could not be tokenized: {type(exc).__name__}: {str(exc)[:200]}",
                           param="messages" if self.chat else "prompt") from None
