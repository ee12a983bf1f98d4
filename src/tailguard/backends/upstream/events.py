"""What a replica's answer becomes at the gateway: token events (``UpstreamEvent``), a request written ahead of its
reader (``Opening``), the error that reaches the client (``UpstreamError``), and the request that carries an answer on
at another replica (``continuation_body``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailguard.backends.upstream.http1 import Sent
from tailguard.backends.upstream.pool import Replica
from tailguard.engine.events import TokenEvent


@dataclass
class UpstreamEvent(TokenEvent):
    replica: str | None = None  # on the final event: the replica that answered, after how many attempts
    attempts: int = 1
    sent: float | None = None  # on the final event: when the answering attempt's request left for the replica
    # The replica answered 200 (its head): the server may send the client's status and headers before the first
    # token, as the replica did. Neither a token nor the end; once per attempt.
    accepted: bool = False
    usage: dict[str, Any] | None = None  # on the final event: the usage the upstream reported, as it wrote it
    reasoning_chunks: int = 0  # on the final event: chunks that carried reasoning text (not the answer's)


@dataclass
class Opening:
    """A request's first attempt, written before the server built the stream that reads it (``UpstreamBackend.open``):
    ``generate_request`` takes it up; ``abandon`` closes its connection if nothing did."""

    replica: Replica
    body: dict[str, Any]
    headers: dict[str, str]
    sent: Sent

    def abandon(self) -> None:
        self.sent.abandon()


class UpstreamError(Exception):
    """An upstream failed: ``status`` is what the client gets (the upstream's own 4xx, or 502/503).

    ``message`` is for the record and the logs. An upstream's own refusal (4xx) reaches the client as the upstream
    wrote it: ``client_message``, ``type``, ``param`` and ``code`` unchanged. ``implicates``: the replica failed while
    it held the request (not merely could not take it), so the request may be what broke it (``backends/upstream/quarantine.py``).
    """

    def __init__(self, status: int, message: str, code: Any = None, retry_after: int | None = None,
                 before_first_token: bool = True, *, implicates: bool = False, client_message: str | None = None,
                 type: str | None = None, param: Any = None) -> None:  # noqa: A002 - the OpenAI field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after
        self.before_first_token = before_first_token
        self.implicates = implicates
        self.client_message = client_message
        self.type = type
        self.param = param


def continuation_body(body: dict[str, Any], chat: bool, sent_text: str, sent_tokens: int,
                      max_tokens: int) -> dict[str, Any] | None:
    """The request that carries on an answer elsewhere after ``sent_tokens`` tokens (``sent_text``) went out.

    Completions: the prompt followed by the text already sent. Chat: the messages plus an assistant message holding
    it, with ``continue_final_message`` (and no generation prompt), the fields vLLM, SGLang and tailguard accept.
    ``max_tokens`` (the request's effective limit) shrinks by the tokens already sent. Before the first token, the
    request as it was. None when the answer cannot be continued (a prompt given as token ids)."""
    out = dict(body)
    if sent_tokens == 0:
        return out
    if chat:
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") and isinstance(last, dict) and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + sent_text}  # it was a continuation already
        else:
            messages.append({"role": "assistant", "content": sent_text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        out.pop("max_completion_tokens", None)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + sent_text
    out["max_tokens"] = max_tokens - sent_tokens
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - sent_tokens)
    return out
