"""The OpenAI request schema the embedded engine accepts, validated strictly: wrong types and unsupported parameters
are refused. In front of upstream replicas (``parse_passthrough``) the API passes through: the upstream validates its
own, and only the fields the gateway acts on are checked here.

A parameter we do not implement is never silently ignored: it is accepted only at its neutral value (``n=1``,
``presence_penalty=0``, ...) and refused otherwise, with a message naming it. vLLM's common extensions ``top_k``,
``min_tokens`` and ``ignore_eos`` are accepted (load generators send ``ignore_eos``), and tailguard's own
``speculative: false`` opts a request out of speculative decoding. vLLM's ``priority`` is accepted and honoured only
from a trusted proxy (``trust_lane_header``: a tailguard gateway in front, with ``send_priority``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailguard import fast_json
from tailguard.api_error import APIError
from tailguard.engine.structured import StructuredOutput
from tailguard.serving.tools import CALL_CLOSE, CALL_OPEN, ToolPlan, plan_tools

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# Every stop string is searched for after every token, on the engine's thread: a bound keeps that cost small.
MAX_STOP_CHARS = 1024

# The most choices one request may ask for (``n``): each is a sequence in the engine, and one client's request must
# not take the whole batch.
MAX_CHOICES = 16

# OpenAI parameters we do not implement, with the value(s) at which they change nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "store": (False,),
    "functions": ([],),
    "function_call": ("none",),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1, max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    speculative: bool = True  # false: this request never speculates (when the engine does)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's field (lower is served first): honoured only from a trusted proxy (trust_lane_header), such as a tailguard
    # gateway with send_priority; otherwise ignored and recorded, as a claimed lane is.
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties over the tokens generated so far, vLLM's repetition penalty, and biases by token id.
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, in the conversation so far
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's and SGLang's fields for continuing an answer: the last (assistant) message is left open, no new turn.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; an answer holds at most one call
    response_format: ResponseFormat | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)


@dataclass
class Parsed:
    """What the handler needs from a validated request."""

    model: str
    stream: bool
    include_usage: bool
    user: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    min_tokens: int
    ignore_eos: bool
    seed: int | None
    stop: list[str]
    speculative: bool
    logprobs: int | None  # number of alternatives per token; None = no logprobs at all
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | None = None  # completions, text prompt
    prompt_token_ids: list[int] | None = None  # completions, pre-tokenized prompt
    add_generation_prompt: bool = True  # chat: open a new assistant turn after the messages
    continue_final_message: bool = False  # chat: the last message (an assistant's) stays open and is continued
    priority: int | None = None  # claimed by the body (vLLM's field); honoured only from a trusted proxy
    raw: dict[str, Any] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None  # JSON mode, a JSON schema, or the tools' grammar
    tools: ToolPlan | None = None  # the functions offered, and what the answer may be
    n: int = 1  # choices: n sequences from one prompt

    def sampling_record(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "seed": self.seed, "stop": self.stop, "logprobs": self.logprobs, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            **({"presence_penalty": self.presence_penalty} if self.presence_penalty else {}),
            **({"frequency_penalty": self.frequency_penalty} if self.frequency_penalty else {}),
            **({"repetition_penalty": self.repetition_penalty} if self.repetition_penalty != 1.0 else {}),
            **({"logit_bias_tokens": len(self.logit_bias)} if self.logit_bias else {}),
            **({"structured": self.structured.kind} if self.structured is not None else {}),
            **({"tools": self.tools.mode} if self.tools is not None else {}),
            **({"n": self.n} if self.n > 1 else {}),
        }


# A \u escape of a UTF-16 surrogate (a pair's half, or a lone one) in a body's bytes.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_json(body: bytes) -> dict[str, Any]:
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        data = fast_json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body) is not None:  # rare: only then is the whole body looked through
        for key, value in data.items():
            bad = _lone_surrogate(key) or _lone_surrogate(value)
            if bad is not None:
                escape = bad.encode("unicode_escape").decode()
                raise APIError(400, f"the request body is not valid Unicode text: '{clean_field(key)}' holds the "
                                    f"lone surrogate {escape}", param=clean_field(key))
    return data


def clean_field(key: str) -> str:
    """A field name as an error may quote it: valid Unicode, at most 80 characters."""
    return key.encode("utf-8", "backslashreplace").decode()[:80]


def _lone_surrogate(obj: Any) -> str | None:
    """The first lone surrogate in any string (keys included) of a decoded JSON value, or None. JSON allows one as an
    escape; it is not Unicode text, so no tokenizer, upstream or log can take it."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as exc:
                return x[exc.start:exc.end][:1]
        elif isinstance(x, dict):
            stack.extend(x)
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


def _more_nodes_than(obj: Any, limit: int) -> bool:
    """Whether a decoded JSON value holds more than ``limit`` keys and items in all, looking at ``limit`` at most."""
    stack, seen = [obj], 0
    while stack:
        x = stack.pop()
        if isinstance(x, dict | list):
            seen += len(x)
            if seen > limit:
                return True
            stack.extend(x.values() if isinstance(x, dict) else x)
    return False


def refuse_oversized(data: dict[str, Any], chat: bool, max_model_len: int, vocab_size: int) -> None:
    """Refuse, before any validation, the lists that cannot fit the context window: a body within the size limit
    can hold millions of token ids or messages, and validating them would hold the event loop for seconds. Each
    token id, message, content part or tool call is at least one token of the prompt; a logit bias names at most
    the vocabulary."""
    limit = max_model_len
    if chat:
        messages = data.get("messages")
        if type(messages) is list:
            items = len(messages)
            if items <= limit:
                for m in messages:
                    if type(m) is dict:
                        items += sum(len(m[k]) for k in ("content", "tool_calls") if type(m.get(k)) is list)
            if items > limit:
                raise APIError(400, f"the conversation has more than {limit:,} messages, content parts and tool "
                                    f"calls; this model's context window is {limit:,} tokens", param="messages",
                               code="context_length_exceeded")
    else:
        prompt = data.get("prompt")
        if type(prompt) is list and prompt:  # token ids, or one prompt's ids in a list (batches: parse_completion)
            ids = prompt[0] if len(prompt) == 1 and type(prompt[0]) is list else prompt
            if len(ids) > limit:
                what = "token ids" if type(ids[0]) is int else "entries"
                raise APIError(400, f"the prompt has {len(ids):,} {what}; this model's context window is {limit:,} "
                                    "tokens", param="prompt", code="context_length_exceeded")
    tools = data.get("tools")
    if type(tools) is list and _more_nodes_than(tools, limit):  # rendered into the prompt: every name a token at least
        raise APIError(400, f"the tools' definitions hold more than {limit:,} names and values; this model's context "
                            f"window is {limit:,} tokens", param="tools", code="context_length_exceeded")
    bias = data.get("logit_bias")
    if type(bias) is dict and len(bias) > vocab_size:
        raise APIError(400, f"logit_bias names {len(bias):,} tokens; the vocabulary has {vocab_size:,}",
                       param="logit_bias", code="invalid_value")


def _check_unsupported(data: dict[str, Any], model_cls: type[BaseModel]) -> dict[str, Any]:
    known = model_cls.model_fields
    clean: dict[str, Any] = {}
    for key, value in data.items():
        if key in known:
            if value is not None or key in ("model", "messages", "prompt"):
                clean[key] = value
            continue
        if key not in _NEUTRAL:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                           code="unrecognized_argument")
        if value is None or value in _NEUTRAL[key]:
            continue
        raise APIError(400, f"parameter '{key}' is not supported by this server (value {json.dumps(value)[:80]})",
                       param=key, code="unsupported_parameter")
    return clean


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return APIError(400, f"invalid value for '{where}': {err.get('msg', 'invalid')}", param=param,
                    code="invalid_value")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise APIError(400, "'stop' takes at most 4 sequences", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "'stop' sequences must be non-empty strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"'stop' sequences may be at most {MAX_STOP_CHARS} characters long", param="stop")
    return stops


def _common(req: _Common, logprobs: int | None) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return dict(
        model=req.model,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        user=req.user,
        priority=req.priority,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        min_tokens=req.min_tokens or 0,
        ignore_eos=req.ignore_eos,
        speculative=req.speculative,
        seed=req.seed,
        stop=_stops(req.stop),
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        n=req.n,
    )


# The fields of the common plain chat request, for ``_plain_chat``.
_PLAIN_CHAT_KEYS = frozenset(("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                              "temperature", "top_p"))
_PLAIN_ROLES = frozenset(("system", "user", "assistant"))


def _count(value: Any) -> bool:
    """A strict positive int (not a bool) of 64 bits, or absent."""
    return value is None or type(value) is int and 1 <= value < 2**63


def _plain_chat(data: dict[str, Any]) -> Parsed | None:
    """The common plain chat request (text messages, a few sampling fields), checked by hand; None for anything
    else, which the schema validates. It accepts only what ``ChatRequest`` accepts and returns what the schema's path
    would (``tests/serving/test_protocol.py`` compares the two on generated requests): the schema's validation is the
    larger part of a gateway request's handling before it is sent on (~30 us of ~230 us on the event loop,
    ``benchmarks/gateway_request_cpu.py``), for requests that are nearly all of this shape."""
    if not _PLAIN_CHAT_KEYS.issuperset(data):
        return None
    model, messages, stream = data.get("model"), data.get("messages"), data.get("stream")
    if type(model) is not str or not 1 <= len(model) <= 512 or type(messages) is not list or not messages:
        return None
    if not (stream is None or type(stream) is bool):
        return None
    max_tokens, max_completion = data.get("max_tokens"), data.get("max_completion_tokens")
    if not _count(max_tokens) or not _count(max_completion):
        return None
    temperature, top_p = data.get("temperature"), data.get("top_p")
    if not (temperature is None or type(temperature) is float and 0.0 <= temperature <= 2.0):
        return None
    if not (top_p is None or type(top_p) is float and 0.0 < top_p <= 1.0):
        return None
    include_usage = False
    options = data.get("stream_options")
    if options is not None:
        if not stream or type(options) is not dict or not {"include_usage"}.issuperset(options):
            return None
        include_usage = options.get("include_usage", False)
        if type(include_usage) is not bool:
            return None
    out = []
    for m in messages:
        if type(m) is not dict or len(m) != 2 or m.get("role") not in _PLAIN_ROLES or type(m.get("content")) is not str:
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return Parsed(model=model, stream=bool(stream), include_usage=include_usage, user=None,
                  max_tokens=max_completion or max_tokens, temperature=1.0 if temperature is None else temperature,
                  top_p=1.0 if top_p is None else top_p, top_k=0, min_tokens=0, ignore_eos=False, seed=None, stop=[],
                  speculative=True, logprobs=None, messages=out, raw=data)


def parse_chat(data: dict[str, Any]) -> Parsed:
    plain = _plain_chat(data)
    if plain is not None:
        return plain
    return _parse_chat_schema(data)


def _parse_chat_schema(data: dict[str, Any]) -> Parsed:
    clean = _check_unsupported(data, ChatRequest)
    try:
        req = ChatRequest.model_validate(clean)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        if m.tool_calls:  # an earlier call, written back the way the model was told to write one
            content = (content or "") + "".join(
                f"{CALL_OPEN}{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)})}"
                f"{CALL_CLOSE}" for c in m.tool_calls)
        # The chat template knows system/user/assistant; OpenAI's "developer" is the new name for "system".
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    plan = plan_tools([t.model_dump() for t in req.tools] if req.tools else None,
                      req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice)
    structured = _response_format(req.response_format)
    if plan is not None:
        if structured is not None:
            raise APIError(400, "'response_format' and 'tools' cannot be combined on this server", param="response_format",
                           code="unsupported_parameter")
        structured = plan.structured()
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{plan.system_text()}"}
        else:
            messages.insert(0, {"role": "system", "content": plan.system_text()})
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                           param="continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise APIError(400, "'continue_final_message' needs the last message to be the assistant's",
                           param="continue_final_message")
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Parsed(max_tokens=max_tokens, messages=messages, raw=data, add_generation_prompt=req.add_generation_prompt,
                  continue_final_message=req.continue_final_message, structured=structured, tools=plan,
                  **_common(req, logprobs))


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: kept as the text it is
        return text


def _response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """OpenAI's ``response_format`` as the engine's structured output (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format json_schema needs 'json_schema.schema'", param="response_format",
                       code="invalid_value")
    return StructuredOutput("json_schema", json.dumps(fmt.json_schema.json_schema))


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if _TOKEN_ID_KEY.fullmatch(key) is None:  # ASCII digits only: str.isdigit() also takes '²'
            raise APIError(400, f"logit_bias keys are token ids, not {key[:40]!r}", param="logit_bias",
                           code="invalid_value")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values lie in [-100, 100] (token {key})", param="logit_bias",
                           code="invalid_value")
        out[int(key)] = float(value)
    return out


def parse_completion(data: dict[str, Any], vocab_size: int) -> Parsed:
    clean = _check_unsupported(data, CompletionRequest)
    try:
        req = CompletionRequest.model_validate(clean)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    prompt: str | list[str] | list[int] | list[list[int]] = req.prompt
    ids: list[int] | None = None
    text: str | None = None
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        one: str | int | list[int] = prompt[0]
        if isinstance(one, list | str):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported: send one request per prompt", param="prompt",
                               code="unsupported_parameter")
            if isinstance(one, str):
                text = one
            else:
                ids = list(one)
        else:
            ids = [t for t in prompt if isinstance(t, int)]
        if ids is not None:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param="prompt")
    else:
        text = prompt
    return Parsed(max_tokens=req.max_tokens or 16, prompt=text, prompt_token_ids=ids, raw=data,
                  **_common(req, req.logprobs))


# tailguard's own request fields: acted on by the gateway, never sent on to an upstream.
OWN_FIELDS = ("speculative",)


def _text_of(content: Any) -> str:
    """A message's text for estimates and records: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def parse_passthrough(data: dict[str, Any], chat: bool) -> Parsed:
    """A request for upstream replicas: the upstream validates its own API, so every field reaches it unchanged
    (tools, response formats, penalties, logprobs, engine extras); only the fields the gateway acts on are checked
    here: ``model`` (routing), ``stream`` and ``stream_options``, the output limit (admission, the SLO's cap),
    ``priority`` (the lane's) and ``user`` (routing by session)."""
    model = data.get("model")
    if type(model) is not str or not 1 <= len(model) <= 512:
        raise APIError(400, "'model' must be a non-empty string", param="model", code="invalid_value")
    stream = data.get("stream")
    if not (stream is None or type(stream) is bool):
        raise APIError(400, "'stream' must be a boolean", param="stream", code="invalid_value")
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options", code="invalid_value")
    limit_key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    limit = data.get(limit_key)
    if not _count(limit):
        raise APIError(400, f"'{limit_key}' must be a positive integer", param=limit_key, code="invalid_value")
    n = data.get("n")
    if not (n is None or type(n) is int and 1 <= n <= MAX_CHOICES):
        raise APIError(400, f"'n' must be an integer from 1 to {MAX_CHOICES}", param="n", code="invalid_value")
    if data.get("best_of") not in (None, 1, n):  # the replicas are asked for n choices each, as n requests
        raise APIError(400, "'best_of' other than 'n' is not supported through the gateway", param="best_of",
                       code="unsupported_parameter")
    priority = data.get("priority")
    if not (priority is None or type(priority) is int):
        raise APIError(400, "'priority' must be an integer", param="priority", code="invalid_value")
    user = data.get("user")
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    if chat:
        raw = data.get("messages")
        if type(raw) is not list or not raw or not all(isinstance(m, dict) for m in raw):
            raise APIError(400, "'messages' must be a non-empty list of message objects", param="messages",
                           code="invalid_value")
        messages = [{"role": str(m.get("role") or ""), "content": _text_of(m.get("content"))} for m in raw]
    else:
        raw_prompt = data.get("prompt")
        if raw_prompt is None:
            raise APIError(400, "'prompt' is required", param="prompt", code="invalid_value")
        prompt = raw_prompt if isinstance(raw_prompt, str) else _text_of(
            [{"text": p} for p in raw_prompt if isinstance(p, str)] if isinstance(raw_prompt, list) else None)

    def number(key: str, default: float) -> float:
        value = data.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default

    stop = data.get("stop")
    return Parsed(
        model=model, stream=bool(stream), include_usage=bool(options and options.get("include_usage")),
        user=user[:256] if isinstance(user, str) else None, max_tokens=limit, temperature=number("temperature", 1.0),
        top_p=number("top_p", 1.0), top_k=int(number("top_k", 0)), min_tokens=int(number("min_tokens", 0)),
        ignore_eos=data.get("ignore_eos") is True, seed=data.get("seed") if type(data.get("seed")) is int else None,
        stop=[stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
        if isinstance(stop, list | str | None) else [],
        speculative=data.get("speculative") is not False, logprobs=None, messages=messages, prompt=prompt,
        priority=priority, raw=data, n=n or 1)
