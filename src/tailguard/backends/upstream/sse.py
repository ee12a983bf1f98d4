"""An upstream's SSE stream read as bytes: events split across or packed into TCP reads, and the few facts the gateway
needs from each ``data:`` payload, taken without a JSON parse for the common chunk.

Per chunk the gateway needs to know only whether it carries a token and that token's text (the server re-encodes it
under the gateway's own id and model name), plus, a few times per request, the finish reason, the usage and a
mid-stream error. A plain token chunk (one text field that is a string, ``finish_reason`` null, no usage) is matched
by byte patterns and its text taken from the string as it stands (decoded by ``json`` only when it holds escapes);
any other chunk (the role chunk, the last ones, an error, a shape not recognised) is parsed in full. The cheap
check falls back to the parse whenever it is not sure, so the answer is the parse's either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tailguard import fast_json
from tailguard.usage import clean_usage

DONE = b"[DONE]"
# The token's text: a chat chunk's ``delta.content`` or a completion chunk's ``text``, a JSON string with its escapes.
# (The string's pattern is unrolled, runs of plain characters then one escape, which a regex engine scans fast.)
_CHAT_TEXT = re.compile(rb'"content"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.S)
_COMPLETION_TEXT = re.compile(rb'"text"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"', re.S)
_FINISH_NULL = re.compile(rb'"finish_reason"\s*:\s*null')
_USAGE_NULL = re.compile(rb'"usage"\s*:\s*null')
_LOGPROBS_NULL = re.compile(rb'"logprobs"\s*:\s*null')
# Fields of a chunk that the gateway passes on as they are (a tool call, reasoning text): never a plain chunk.
_PASSED_ON = (b'"tool_calls"', b'"reasoning', b'"function_call"', b'"refusal"', b'"audio"')


# The longest SSE line taken from an upstream (a chunk with logprobs and tool calls is a few KiB): past it the stream
# is the upstream's fault, not something to buffer without end.
MAX_LINE_BYTES = 4 << 20


class SSELineTooLong(ValueError):
    """An upstream sent a line longer than MAX_LINE_BYTES."""


class SSELines:
    """Splits the bytes of an event stream into ``data:`` payloads, whatever the TCP reads cut.

    ``feed`` takes the bytes of one read and returns the payloads of the lines it completed; a line cut by the read
    waits for the next one, each read's bytes scanned once (a line that never ends costs its length, not its length
    squared), and one longer than ``max_line`` raises SSELineTooLong. Comments, ``event:``/``id:`` fields and blank
    lines are dropped (the gateway needs only the data)."""

    __slots__ = ("_rest", "max_line")

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._rest = bytearray()
        self.max_line = max_line

    def feed(self, data: bytes) -> list[bytes]:
        end = data.rfind(b"\n")
        if end < 0:
            self._rest += data
            if len(self._rest) > self.max_line:
                raise SSELineTooLong(f"the upstream sent an SSE line longer than {self.max_line:,} bytes")
            return []
        if self._rest:
            self._rest += data[:end]
            lines, self._rest = bytes(self._rest).split(b"\n"), bytearray(data[end + 1:])
        else:
            lines, self._rest = data[:end].split(b"\n"), bytearray(data[end + 1:])
        if len(self._rest) > self.max_line or (len(lines[0]) > self.max_line):
            raise SSELineTooLong(f"the upstream sent an SSE line longer than {self.max_line:,} bytes")
        out = []
        for line in lines:
            if line.startswith(b"data:"):
                out.append(line[5:].strip())  # also drops the \r of CRLF line ends
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an unfinished line (the stream should end on a line end)."""
        return bytes(self._rest)


@dataclass(slots=True)
class Chunk:
    """What one ``data:`` payload says: ``text`` (None: no token), ``finish_reason``, ``usage`` and ``error``."""

    text: str | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    error_body: dict | None = None  # the error object as the upstream wrote it (its code, type, param)
    passthrough: dict[str, Any] | None = None  # fields passed on as written: ``delta`` extras, ``logprobs``
    reasoning: bool = False  # the chunk carries reasoning text (DeepSeek-style ``reasoning_content``)


def _plain_text(payload: bytes, chat: bool) -> re.Match[bytes] | None:
    """The match of a plain chunk's text string (empty: the role chunk's, no token), or None when the chunk needs
    the full parse."""
    m = (_CHAT_TEXT if chat else _COMPLETION_TEXT).search(payload)
    if m is None or not _FINISH_NULL.search(payload) or payload.count(b'"index"') > 1:
        return None  # not a plain chunk of one choice
    if b'"usage"' in payload and not _USAGE_NULL.search(payload):
        return None
    if b'"logprobs"' in payload and not _LOGPROBS_NULL.search(payload):
        return None
    if any(key in payload for key in _PASSED_ON) and passed_on(payload, chat):
        return None
    return m


def passed_on(payload: bytes, chat: bool) -> bool:
    """Whether a chunk holds fields to pass on (decided by the parse: the keys' bytes may be inside the text)."""
    try:
        return bool(read_chunk(payload, chat).passthrough)
    except ValueError:
        return True


def _decode(raw: bytes) -> str | None:
    """A JSON string's body as text (None: not valid UTF-8, for the parse to report)."""
    if b"\\" in raw:
        return fast_json.loads(b'"' + raw + b'"')
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def token_text(payload: bytes, chat: bool) -> str | None:
    """The token text of a plain chunk ("" for one without a token, as the role chunk that opens a stream), or None
    when the chunk needs the full parse (not that it has no token: ``read_chunk`` decides that)."""
    m = _plain_text(payload, chat)
    return None if m is None else _decode(m.group(1))


class TokenTexts:
    """``token_text`` for one stream, faster once it has seen a plain chunk: an upstream's token chunks are the same
    bytes around the text (its id, creation time and model, then ``finish_reason: null``), so a payload that starts
    and ends as the last plain one did, with no quote in between, is a plain chunk whose text is what lies between.
    Anything else goes through ``token_text`` (and a new plain shape is learned from it)."""

    __slots__ = ("chat", "_head", "_tail")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self._head: bytes | None = None
        self._tail = b""

    def __call__(self, payload: bytes) -> str | None:
        head, tail = self._head, self._tail
        if head is not None and payload.startswith(head) and payload.endswith(tail) \
                and len(payload) > len(head) + len(tail):
            raw = payload[len(head):len(payload) - len(tail)]
            if b'"' not in raw:  # else the text may end early and other fields follow: let the pattern decide
                return _decode(raw)
        m = _plain_text(payload, self.chat)
        if m is None:
            return None
        if m.end(1) > m.start(1):  # the role chunk's shape (empty text, a role) is not the tokens'
            self._head, self._tail = payload[:m.start(1)], payload[m.end(1):]
        return _decode(m.group(1))


def read_chunk(payload: bytes, chat: bool) -> Chunk:
    """Parse one payload in full (raises ``ValueError`` for data that is not JSON, or not a chunk's shape: choices
    that are not objects, a text or finish reason that is not a string)."""
    obj: Any = fast_json.loads(payload)
    if not isinstance(obj, dict):
        raise ValueError("an SSE data payload that is not a JSON object")
    out = Chunk()
    err = obj.get("error")
    if err and not obj.get("choices"):
        out.error = str(err.get("message", err) if isinstance(err, dict) else err)
        out.error_body = err if isinstance(err, dict) else None
        return out
    if obj.get("usage"):
        out.usage = clean_usage(obj["usage"])
    choices = obj.get("choices") or []
    if not isinstance(choices, list):
        raise ValueError("a chunk's 'choices' that is not a list")
    texts = []
    for ch in choices:
        if not isinstance(ch, dict):
            raise ValueError("a chunk's choice that is not an object")
        delta = (ch.get("delta") or {}) if chat else {}
        if not isinstance(delta, dict):
            raise ValueError("a chunk's 'delta' that is not an object")
        text = delta.get("content") if chat else ch.get("text")
        finish = ch.get("finish_reason")
        if not (text is None or isinstance(text, str)) or not (finish is None or isinstance(finish, str)):
            raise ValueError("a chunk's text or finish reason that is not a string")
        if finish:
            out.finish_reason = finish
        if text:
            texts.append(text)
        extra = {k: v for k, v in delta.items() if k not in ("role", "content") and v is not None}
        lp = ch.get("logprobs")
        if extra or lp:
            out.passthrough = {"delta": extra or None, "logprobs": lp or None}
            out.reasoning = out.reasoning or any(k.startswith("reasoning") for k in extra)
    if texts:
        out.text = "".join(texts)
    return out
