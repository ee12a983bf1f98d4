"""Tool calling and JSON output on the embedded engine, by grammar-constrained decoding (engine/structured.py).

The model is told the functions in its system message (SmolLM2's chat template has no tools of its own), in the
Hermes style most small instruct models know: signatures as JSON schemas between ``<tools>`` tags, a call written
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. What it may write is then held to a grammar:

- ``tool_choice: "required"`` or a named function: the whole answer is one call, a JSON object whose ``name`` is one
  of the functions (that one) and whose ``arguments`` follow its parameters' schema;
- ``"auto"`` (the default with tools): the answer is either text that does not open with ``<tool_call>``, or one call
  in the tags;
- ``"none"``: the functions are not offered, and nothing is constrained.

The call comes back in OpenAI's shape: ``message.tool_calls`` (streamed: one ``tool_calls`` delta once the call is
complete, as its arguments must parse) and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tailguard.api_error import APIError
from tailguard.engine.structured import JSON_DEFAULTS, StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools and tool choice mean for its prompt, its grammar and its answer."""

    mode: str  # "required" (the answer is one call) or "auto" (text, or one call in tags)
    functions: list[dict[str, Any]] = field(default_factory=list)

    def system_text(self) -> str:
        sigs = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions)
        how = ("Answer with one function call, as JSON: {\"name\": <function name>, \"arguments\": <arguments>}."
               if self.mode == "required" else
               f"To call a function, answer with {CALL_OPEN}{{\"name\": <function name>, \"arguments\": "
               f"<arguments>}}{CALL_CLOSE}; otherwise answer in text.")
        return f"You can call these functions:\n<tools>\n{sigs}\n</tools>\n{how}"

    def structured(self) -> StructuredOutput:
        call = _call_schema(self.functions)
        if self.mode == "required":
            return StructuredOutput("json_schema", json.dumps(call))
        # Text that does not open a call, or one call in its tags (llguidance's Lark with an inline JSON schema, given
        # the engine's compact JSON explicitly: inline schemas do not get its defaults).
        inline = {**call, "x-guidance": JSON_DEFAULTS}
        grammar = (f"start: text | call\ncall: \"{CALL_OPEN}\" json_call \"{CALL_CLOSE}\"\n"
                   f"json_call: %json {json.dumps(inline)}\ntext: /[^<][\\s\\S]*/ | /<[^t][\\s\\S]*/\n")
        return StructuredOutput("grammar", grammar)


def _call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ToolPlan | None:
    """The plan for a request's ``tools`` and ``tool_choice`` (None: no tool is offered)."""
    if not tools or tool_choice == "none":
        return None
    functions = [t["function"] for t in tools]
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", functions)
    if tool_choice == "required":
        return ToolPlan("required", functions)
    name = tool_choice["function"]["name"]
    chosen = [f for f in functions if f["name"] == name]
    if not chosen:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice", code="invalid_value")
    return ToolPlan("required", chosen)


def call_of(text: str, plan: ToolPlan) -> dict[str, Any] | None:
    """The call an answer holds (``{"name", "arguments"}``, arguments as a JSON string), or None for a text answer."""
    body = text.strip()
    if plan.mode == "auto":
        if not body.startswith(CALL_OPEN):
            return None
        body = body[len(CALL_OPEN):].removesuffix(CALL_CLOSE)
    try:
        obj = json.loads(body)
    except ValueError:
        return None  # cut short (max_tokens): the text is the answer
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False)}


class CallStream:
    """A streamed answer under tools: text that cannot open a call goes out as it comes; a call is held until the
    answer ends (its arguments must parse before the client sees them)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held: list[str] = []
        self.passing = False  # the answer is text: every piece goes out as it comes

    def feed(self, text: str) -> str:
        if self.passing:
            return text
        self.held.append(text)
        so_far = "".join(self.held)
        if self.plan.mode == "auto" and not CALL_OPEN.startswith(so_far[:len(CALL_OPEN)]):
            self.passing = True
            self.held.clear()
            return so_far
        return ""

    def finish(self, last: str) -> tuple[str, dict[str, Any] | None]:
        """What remains to send as text, and the call, once the answer has ended."""
        if self.passing:
            return last, None
        whole = "".join(self.held) + last
        call = call_of(whole, self.plan)
        return ("", call) if call is not None else (whole, None)


def tool_call_delta(call: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A call in OpenAI's shape (``tool_calls[0]`` of a message, or of a delta with its ``index``)."""
    return {"index": 0, "id": f"call_{request_id[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": call["arguments"]}}
