"""OpenAI response objects and SSE chunks, built fast.

The per-token chunk is the hot path (one per streamed token): its constant JSON prefix and suffix are encoded once per
request and only the text delta is escaped per token. Everything else goes through ``json.dumps``.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # the C string escaper json.dumps uses
from typing import Any

_DONE = b"data: [DONE]\n\n"


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token pieces -> raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()


class TokenText:
    """Token id -> (display string, raw bytes) for logprobs, cached. A token that is part of a UTF-8 character shows
    as ``bytes:\\xe4\\xbd`` (OpenAI's convention) with its true bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        # Byte-level BPE pieces (GPT-2 notation) when the tokenizer exposes its vocabulary; else decode one token.
        self._pieces = getattr(tokenizer, "tokens", None)
        self._special: set[int] = getattr(tokenizer, "special_ids", set())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, tid: int) -> bytes:
        pieces = self._pieces
        if pieces is not None and 0 <= tid < len(pieces):
            piece = pieces[tid]
            if tid in self._special:
                return piece.encode("utf-8")
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        return self.tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def get(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is None:
            raw = self._bytes(tid)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = (text, list(raw))
            if len(self._cache) < 200_000:
                self._cache[tid] = hit
        return hit


def chat_logprobs(tt: TokenText, items: list[tuple[int, float | None, list[tuple[int, float]] | None]]) -> dict:
    content = []
    for tid, lp, top in items:
        text, raw = tt.get(tid)
        alts = []
        for alt_id, alt_lp in top or []:
            alt_text, alt_raw = tt.get(alt_id)
            alts.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(tt: TokenText, items: list[tuple[int, float | None, list[tuple[int, float]] | None]],
                        offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp, top in items:
        text, _ = tt.get(tid)
        tokens.append(text)
        lps.append(lp)
        tops.append({tt.get(a)[0]: alp for a, alp in top or []})
        offsets.append(pos)
        pos += len(text) if not text.startswith("bytes:") else 0
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat:
    object_full = "chat.completion"

    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = created
        head = json.dumps({"id": self.id, "object": "chat.completion.chunk", "created": created, "model": model})[:-1]
        self._head = head
        self._content_head = (f'data: {head},"choices":[{{"index":0,"delta":{{"content":').encode()
        self._content_tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'

    def _chunk(self, choices: list, **extra: Any) -> bytes:
        obj = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def role(self, system_fingerprint: str | None = None, index: int = 0) -> bytes:
        if not system_fingerprint and not index:  # the common case, on every stream's first-token path: no encoder
            return (f'data: {self._head},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                    f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()
        extra = {"system_fingerprint": system_fingerprint} if system_fingerprint else {}
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], **extra)

    def content(self, text: str, index: int = 0) -> bytes:
        if index:
            return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        return self._content_head + encode_basestring(text).encode() + self._content_tail

    def content_logprobs(self, text: str, logprobs: dict, index: int = 0) -> bytes:
        return self._chunk([{"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}])

    def tool_call(self, call: dict[str, Any], index: int = 0) -> bytes:
        """A chunk with one whole function call (``call``: a ``tool_calls`` item with its index)."""
        return self._chunk([{"index": index, "delta": {"tool_calls": [call]}, "logprobs": None,
                             "finish_reason": None}])

    def passthrough(self, text: str, fields: dict[str, Any], index: int = 0) -> bytes:
        """A chunk with an upstream's own delta fields (tool calls, reasoning) and logprobs, as it wrote them."""
        delta = {"content": text} if text else {}
        delta.update(fields.get("delta") or {})
        return self._chunk([{"index": index, "delta": delta, "logprobs": fields.get("logprobs"),
                             "finish_reason": None}])

    def finish(self, text: str, reason: str, logprobs: dict | None, index: int = 0, **extra: Any) -> bytes:
        delta = {"content": text} if text else {}
        return self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}], **extra)

    def usage(self, usage: dict, **extra: Any) -> bytes:
        return self._chunk([], usage=usage, **extra)

    @staticmethod
    def choice(text: str, reason: str, logprobs: dict | None, message: dict | None = None, index: int = 0) -> dict:
        body = {"role": "assistant", "content": text if text or not message else None, **(message or {})}
        return {"index": index, "message": body, "logprobs": logprobs, "finish_reason": reason}

    def full(self, text: str, reason: str, usage: dict, logprobs: dict | None, message: dict | None = None,
             **extra: Any) -> dict:
        return self.full_choices([self.choice(text, reason, logprobs, message)], usage, **extra)

    def full_choices(self, choices: list[dict], usage: dict, **extra: Any) -> dict:
        return {"id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, **extra}


class CompletionFormat:
    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.id = f"cmpl-{request_id}"
        self.model = model
        self.created = created
        head = json.dumps({"id": self.id, "object": "text_completion", "created": created, "model": model})[:-1]
        self._content_head = (f'data: {head},"choices":[{{"index":0,"text":').encode()
        self._content_tail = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def _chunk(self, choices: list, **extra: Any) -> bytes:
        obj = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def role(self, system_fingerprint: str | None = None, index: int = 0) -> bytes:
        return b""  # a completion stream has no role chunk

    def content(self, text: str, index: int = 0) -> bytes:
        if index:
            return self._chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])
        return self._content_head + encode_basestring(text).encode() + self._content_tail

    def content_logprobs(self, text: str, logprobs: dict, index: int = 0) -> bytes:
        return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}])

    def passthrough(self, text: str, fields: dict[str, Any], index: int = 0) -> bytes:
        """A chunk with an upstream's own logprobs, as it wrote them."""
        return self._chunk([{"index": index, "text": text, "logprobs": fields.get("logprobs"), "finish_reason": None}])

    def finish(self, text: str, reason: str, logprobs: dict | None, index: int = 0, **extra: Any) -> bytes:
        return self._chunk([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}], **extra)

    def usage(self, usage: dict, **extra: Any) -> bytes:
        return self._chunk([], usage=usage, **extra)

    @staticmethod
    def choice(text: str, reason: str, logprobs: dict | None, message: dict | None = None, index: int = 0) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def full(self, text: str, reason: str, usage: dict, logprobs: dict | None, message: dict | None = None,
             **extra: Any) -> dict:
        return self.full_choices([self.choice(text, reason, logprobs)], usage, **extra)

    def full_choices(self, choices: list[dict], usage: dict, **extra: Any) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage, **extra}


def sse_error(message: str, type_: str = "server_error", code: str | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}, ensure_ascii=False)
    return b"data: " + body.encode() + b"\n\n" + _DONE


DONE = _DONE
