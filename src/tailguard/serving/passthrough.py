"""An upstream's own answer fields, passed on as it wrote them: tool calls, reasoning text, logprobs.

Streamed, each chunk that carries them is written again under the gateway's id and model with its delta and
logprobs unchanged. Whole (a client that did not stream: the gateway streams from the upstream all the same), the
deltas are put back together the way OpenAI's client libraries do: strings concatenated in order (``content``,
``reasoning_content``), tool calls merged by their ``index`` (the first delta of a call brings its ``id``, ``type``
and function ``name``; the ``arguments`` string arrives in pieces), logprobs' lists concatenated.
"""

from __future__ import annotations

from typing import Any


class Reassembly:
    """The message fields (other than ``content``) and the logprobs of a whole answer, from its chunks."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, Any] | None = None

    def add(self, passthrough: dict[str, Any]) -> None:
        delta = passthrough.get("delta") or {}
        for key, value in delta.items():
            if key == "tool_calls" and isinstance(value, list):
                for call in value:
                    if isinstance(call, dict):
                        self._call(call)
            elif isinstance(value, str) and isinstance(self.fields.get(key), str):
                self.fields[key] += value
            else:
                self.fields[key] = value
        lp = passthrough.get("logprobs")
        if isinstance(lp, dict):
            self._logprobs(lp)

    def _call(self, part: dict[str, Any]) -> None:
        index = part.get("index", len(self.calls))
        call = self.calls.setdefault(index if isinstance(index, int) else len(self.calls), {})
        for key, value in part.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                fn = call.setdefault("function", {})
                for k, v in value.items():
                    fn[k] = fn.get(k, "") + v if k == "arguments" and isinstance(v, str) else v
            else:
                call[key] = value

    def _logprobs(self, lp: dict[str, Any]) -> None:
        if self.logprobs is None:
            self.logprobs = {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
            return
        for key, value in lp.items():
            have = self.logprobs.get(key)
            if isinstance(have, list) and isinstance(value, list):
                have.extend(value)
            elif have is None:
                self.logprobs[key] = value

    def message_fields(self) -> dict[str, Any]:
        """What the whole answer's message holds beside its role and content."""
        out = dict(self.fields)
        if self.calls:
            out["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return out
