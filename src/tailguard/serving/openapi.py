"""The OpenAPI 3.1 document of the API as this server serves it (``GET /openapi.json``), in its two modes.

Over the embedded engine the request bodies are the JSON schemas of the pydantic models that validate them
(``serving/protocol.py``), with the OpenAI parameters accepted only at their neutral value added from the same table:
the document cannot drift from what is validated. As a gateway (``--upstream``) the API passes through: a request's
schema requires only what ``parse_passthrough`` checks and lets every other field through to the upstream.

The answers are described by the pydantic models below, written for what ``serving/responses.py`` and
``serving/respond.py`` produce. Where the answer is ours alone (our chunks, our bodies, the ``tailguard`` object) a
model is closed (``additionalProperties: false``): a new field must be documented here, or ``tests/serving/test_openapi.py``
fails. What a gateway passes on as the upstream wrote it (a message's and a delta's own fields such as ``tool_calls``
and ``reasoning_content``, logprobs, usage, the answers of ``/v1/responses`` and ``/v1/embeddings``) is open: in
gateway mode those components are replaced by their open versions (``_GATEWAY_COMPONENTS``).

Built once per mode and process (``document_bytes``); the route is ``serving/routes/openapi.py``.
"""

from __future__ import annotations

import copy
import enum
import functools
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, SkipJsonSchema, models_json_schema
from pydantic_core import core_schema

import tailguard
from tailguard.observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tailguard.serving import protocol
from tailguard.serving.protocol import MAX_CHOICES, ChatRequest, CompletionRequest
from tailguard.serving.routes.slo import ALERT_KINDS, TIER_NAMES

SCHEMAS = "#/components/schemas/"


class _Closed(BaseModel):
    """An object the server writes itself: no field beyond those documented."""

    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """An object (partly) as an upstream wrote it: other fields may come too."""

    model_config = ConfigDict(extra="allow")


# --- the ``tailguard`` extension object (observe/timeline.py: Timeline.stage_object) ----------------------------


class StageTimes(_Closed):
    """The five stages of the request, in seconds; they add up to ``e2e`` (docs/metrics.md)."""

    tokenize: float
    queue: float
    prefill: float
    decode: float
    stream: float


class DegradedAction(_Closed):
    """What the SLO monitor (or a stalled stream) changed in this answer."""

    action: Literal["degrade"]
    mode: str = Field(description="`truncate` (a lower max_tokens), `template` (a canned answer, no model call), "
                                  "`stall` (the stream stopped; the lane's notice ends it) or `fallback` (a stalled "
                                  "stream continued on another replica)")
    tier: str = Field(description="`red`, or `stream` for a stall")
    scope: str
    action_id: str
    reason: str
    max_tokens: int | SkipJsonSchema[None] = Field(None, description="truncate: the cap the answer ran under")
    requested_max_tokens: int | SkipJsonSchema[None] = Field(None, description="truncate: what the request asked")
    truncated_by: str | None = Field(
        None, description="fallback: the truncation still in force (its action id)")


class TailguardInfo(_Closed):
    """tailguard's own top-level field on a whole answer and on a stream's last chunk: the request's stage times so
    far, in seconds (the record itself: `GET /v1/requests/{request_id}`)."""

    request_id: str
    stages: StageTimes
    e2e: float
    ttft: float | None
    tpot: float | None
    queue_wait: float
    prompt_tokens: int
    output_tokens: int
    degraded: DegradedAction | SkipJsonSchema[None] = Field(
        None, description="present only when the answer was degraded (its `system_fingerprint` says so too)")


_FINGERPRINT = Field(None, description="present only on a degraded answer: `tailguard-degraded:<mode>`")


# --- parts of the answers that a gateway passes on: closed here, opened in gateway mode -------------------------


class FinishReason(enum.StrEnum):
    """Why the answer ended."""

    stop = "stop"
    length = "length"
    tool_calls = "tool_calls"


class PromptTokensDetails(_Closed):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(_Closed):
    """The tokens really produced (a template answer counts none)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | SkipJsonSchema[None] = Field(
        None, description="present when part of the prompt was served from the prefix cache")


class TopLogprob(_Closed):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(_Closed):
    token: str = Field(description="the token's text; a token that is part of a UTF-8 character is "
                                   "`bytes:\\xe4\\xbd` with its true bytes in `bytes`")
    logprob: float | None = Field(description="null where the engine gives none (the scripted fake engine)")
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Closed):
    content: list[TokenLogprob]


class CompletionLogprobs(_Closed):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ClosedFunctionCall(_Closed):
    name: str
    arguments: str = Field(description="the arguments, a JSON text that follows the function's parameters")


class ClosedToolCall(_Closed):
    id: str
    type: Literal["function"]
    function: ClosedFunctionCall


class ClosedToolCallDelta(ClosedToolCall):
    """The whole call in one delta: sent once the call is complete (its arguments parse)."""

    index: int


class ChatCompletionMessage(_Closed):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is a function call")
    tool_calls: list[ClosedToolCall] | SkipJsonSchema[None] = Field(
        None, description="with tools: the call the answer is (finish_reason tool_calls)")


class ChatDelta(_Closed):
    """A piece of the message: the role on the first chunk, then text (or, with tools, one whole call)."""

    role: Literal["assistant"] | SkipJsonSchema[None] = None
    content: str | SkipJsonSchema[None] = None
    tool_calls: list[ClosedToolCallDelta] | SkipJsonSchema[None] = None


# Their open versions, which replace them in gateway mode (under the same component names).


class UpstreamFinishReason(enum.StrEnum):
    """Why the answer ended (an upstream's reason, as it gave it)."""

    stop = "stop"
    length = "length"
    tool_calls = "tool_calls"
    content_filter = "content_filter"
    function_call = "function_call"


class UpstreamUsage(_Open):
    """The upstream's usage as it reported it (its token details included); the counts are the whole answer's."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class UpstreamLogprobs(_Open):
    """Logprobs as the upstream wrote them (the chunks' lists put together for a whole answer)."""


class FunctionCall(_Open):
    name: str
    arguments: str = Field(description="the arguments, a JSON text")


class ToolCall(_Open):
    id: str
    type: str = Field(description="`function`")
    function: FunctionCall


class FunctionCallDelta(_Open):
    name: str | SkipJsonSchema[None] = None
    arguments: str | SkipJsonSchema[None] = Field(None, description="the next piece of the arguments' JSON text")


class ToolCallDelta(_Open):
    """A piece of a tool call: its first delta brings ``id``, ``type`` and the function's ``name``; the
    ``arguments`` arrive in pieces. Merged by ``index``."""

    index: int
    id: str | SkipJsonSchema[None] = None
    type: str | SkipJsonSchema[None] = None
    function: FunctionCallDelta | SkipJsonSchema[None] = None


class UpstreamChatMessage(_Open):
    """The message, with the upstream's own fields as it wrote them (tool calls, reasoning text, ...)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | SkipJsonSchema[None] = None
    reasoning_content: str | SkipJsonSchema[None] = None


class UpstreamChatDelta(_Open):
    """A piece of the message, with the upstream's own delta fields as it wrote them (tool calls, reasoning)."""

    role: Literal["assistant"] | SkipJsonSchema[None] = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | SkipJsonSchema[None] = None
    reasoning_content: str | None = None


_GATEWAY_COMPONENTS: dict[str, type[BaseModel] | type[enum.Enum]] = {
    "FinishReason": UpstreamFinishReason,
    "Usage": UpstreamUsage,
    "ChatLogprobs": UpstreamLogprobs,
    "CompletionLogprobs": UpstreamLogprobs,
    "ChatCompletionMessage": UpstreamChatMessage,
    "ChatDelta": UpstreamChatDelta,
}


# --- the answers -------------------------------------------------------------------------------------------------


class ChatChoice(_Closed):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Closed):
    """A whole chat answer (`stream` false)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    tailguard: TailguardInfo
    system_fingerprint: str | SkipJsonSchema[None] = _FINGERPRINT


class ChatChunkChoice(_Closed):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Closed):
    """One server-sent event of a streamed chat answer. The first chunk brings the role; the chunk with a
    `finish_reason` is the last with a choice; with `stream_options.include_usage` a last chunk with no choice
    brings the usage. The last chunk carries the `tailguard` object."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | SkipJsonSchema[None] = Field(None, description="on the last chunk, with `include_usage`")
    tailguard: TailguardInfo | SkipJsonSchema[None] = Field(None, description="on the last chunk")
    system_fingerprint: str | SkipJsonSchema[None] = _FINGERPRINT


class CompletionChoice(_Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(_Closed):
    """A whole completion (`stream` false)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    tailguard: TailguardInfo
    system_fingerprint: str | SkipJsonSchema[None] = _FINGERPRINT


class CompletionChunkChoice(_Closed):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(_Closed):
    """One server-sent event of a streamed completion (OpenAI's object name, `text_completion`, as for a whole
    one). The chunk with a `finish_reason` is the last with a choice; with `stream_options.include_usage` a last
    chunk with no choice brings the usage. The last chunk carries the `tailguard` object."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | SkipJsonSchema[None] = Field(None, description="on the last chunk, with `include_usage`")
    tailguard: TailguardInfo | SkipJsonSchema[None] = Field(None, description="on the last chunk")
    system_fingerprint: str | SkipJsonSchema[None] = _FINGERPRINT


class Model(_Closed):
    id: str = Field(description="a name clients may send as `model`")
    object: Literal["model"]
    created: int
    owned_by: str
    root: str = Field(description="the model this name serves")
    max_model_len: int | None = Field(description="the context window in tokens (0 where a gateway does not know)")


class ModelList(_Closed):
    object: Literal["list"]
    data: list[Model]


class ErrorDetail(_Closed):
    message: str
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `permission_error`, "
                                  "`rate_limit_error`, `server_error`, `service_unavailable`, ...")
    param: str | None = Field(description="the request field at fault, if one is")
    code: str | None = Field(description="a stable code: `invalid_value`, `model_not_found`, `queue_full`, ...")


class ErrorResponse(_Closed):
    """An error, in OpenAI's shape."""

    error: ErrorDetail


class Health(_Closed):
    status: Literal["ok", "failed"]
    error: str | SkipJsonSchema[None] = None


class Readiness(_Closed):
    status: Literal["ready", "draining", "unavailable", "failed", "loading"]
    model: str | SkipJsonSchema[None] = Field(None, description="when ready")
    error: str | None = Field(None, description="why not ready")


class AlertList(_Closed):
    """Alert, action, hook, advisory and objective records (docs/slo.md), oldest first."""

    object: Literal["list"]
    enabled: bool = Field(description="whether the SLO monitor runs")
    data: list[dict[str, Any]]
    tier: str | SkipJsonSchema[None] = Field(None, description="the current tier, when the monitor runs",
                                             json_schema_extra={"enum": list(TIER_NAMES)})
    dry_run: bool | SkipJsonSchema[None] = None
    active: list[dict[str, Any]] | SkipJsonSchema[None] = Field(None, description="the alerts firing now")


class RequestRecord(_Open):
    """One request's record, times in seconds (docs/metrics.md)."""

    request_id: str
    received_at: float = Field(description="unix seconds")
    endpoint: str
    model: str
    status: int
    outcome: str | None
    finish_reason: str | None
    error: str | None
    prompt_tokens: int
    output_tokens: int
    e2e: float
    ttft: float | None
    tpot: float | None
    stages: dict[str, float]
    timestamps: dict[str, float | None]


class Embedding(_Open):
    object: str = Field(description="`embedding`")
    index: int
    embedding: list[float] | str = Field(description="the vector (a base64 string with `encoding_format: base64`)")


class EmbeddingList(_Open):
    """The upstream's answer, as it wrote it."""

    object: str = Field(description="`list`")
    data: list[Embedding]
    model: str


class UpstreamAnswer(_Open):
    """The upstream's answer, as it wrote it (OpenAI's Responses API)."""


# --- the gateway's request bodies: only what the gateway acts on is checked (parse_passthrough) -------------------

_COUNT = Field(None, ge=1, lt=2**63, description="checked by the gateway (admission, the SLO's cap), then passed on")
_CHOICES = "choices, 1 to 16: each is asked of the replica as its own request, seeded `seed + i`"
_PASS_ON = "Every other field passes to the upstream unchanged (but `speculative`, tailguard's own)."


class _Passthrough(_Open):
    model: str = Field(min_length=1, max_length=512, description="routes the request; must be a served name")
    stream: bool | None = None
    stream_options: dict[str, Any] | None = Field(None, description="`include_usage` is read; passed on")
    max_tokens: int | None = _COUNT
    priority: int | None = Field(None, description="vLLM's field: the lane's, from a trusted proxy")
    user: Any = Field(None, description="a string keeps a session on one replica")
    speculative: Any = Field(None, description="tailguard's own: read here, never sent on")


class GatewayChatRequest(_Passthrough):
    __doc__ = "A chat request for the upstream replicas. " + _PASS_ON

    messages: list[dict[str, Any]] = Field(min_length=1, description="message objects, passed on as they are")
    max_completion_tokens: int | None = _COUNT
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description=_CHOICES)


class GatewayCompletionRequest(_Passthrough):
    __doc__ = "A completion request for the upstream replicas. " + _PASS_ON

    prompt: Any = Field(description="text, texts or token ids: passed on as they are")
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description=_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="1 or equal to `n`")


class GatewayForwardRequest(_Open):
    __doc__ = "Passed on to a replica as it is (but `speculative`)."

    model: str = Field(description="must be a served name")


# --- the JSON schemas ----------------------------------------------------------------------------------------------


class _Generator(GenerateJsonSchema):
    """pydantic's JSON schema, without a title on every property and without ``default: null`` (a field that may be
    absent is simply not required)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        out = super().default_schema(schema)
        if "default" in out and out["default"] is None:
            del out["default"]
        return out


_RESPONSES: list[type[BaseModel]] = [ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, ModelList,
                                     ErrorResponse, Health, Readiness, AlertList, RequestRecord]


def _allows_null(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "null" or None in prop.get("enum", ()) or any(
        a.get("type") == "null" for a in prop.get("anyOf", ()))


def _request(schema: dict[str, Any]) -> None:
    """A request model's schema as the server validates it: a null top-level field is taken as absent (but the
    required ones), and the OpenAI parameters the server does not implement are accepted only at the value at which
    they change nothing (``protocol._NEUTRAL``); any other value is refused with a 400 naming it."""
    props = schema["properties"]
    for key, prop in list(props.items()):
        if key not in schema.get("required", ()) and not _allows_null(prop):
            default = prop.pop("default", None)
            props[key] = {"anyOf": [prop, {"type": "null"}], **({"default": default} if default is not None else {})}
    for key, values in protocol._NEUTRAL.items():
        if key not in props:
            allowed: list[Any] = []
            for v in (*values, None):  # 0 and 0.0 are one JSON value
                if v not in allowed:
                    allowed.append(v)
            props[key] = {"enum": allowed, "description": "not implemented: accepted only where it changes "
                                                          "nothing (these values, or null)"}


def _schemas(gateway: bool) -> dict[str, Any]:
    models: list[type[BaseModel]] = list(_RESPONSES)
    if gateway:
        models += [GatewayChatRequest, GatewayCompletionRequest, GatewayForwardRequest, EmbeddingList, UpstreamAnswer]
        models += [m for m in _GATEWAY_COMPONENTS.values() if issubclass(m, BaseModel)]
    else:
        models += [ChatRequest, CompletionRequest]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=SCHEMAS + "{model}",
                                schema_generator=_Generator)
    defs: dict[str, Any] = top["$defs"]
    if gateway:
        for name, model in _GATEWAY_COMPONENTS.items():
            if issubclass(model, BaseModel):
                defs[name] = copy.deepcopy(defs[model.__name__])
            else:
                defs[name] = {"type": "string", "enum": [m.value for m in model], "description": model.__doc__}
            defs[name]["title"] = name
        for model in set(_GATEWAY_COMPONENTS.values()):
            defs.pop(model.__name__, None)
    else:
        _request(defs["ChatRequest"])
        _request(defs["CompletionRequest"])
    return defs


# --- the document --------------------------------------------------------------------------------------------------


def _ref(name: str) -> dict[str, str]:
    return {"$ref": SCHEMAS + name}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _error(description: str, retry: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": _json("ErrorResponse")}
    if retry:
        out["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
    return out


_ERRORS = {
    "BadRequest": _error("The request is not valid (the message and `param` say why)."),
    "Unauthorized": _error("A missing or wrong API key."),
    "Forbidden": _error("The key may not read this (an admin surface, another client's record)."),
    "NotFound": _error("No such model, record or route."),
    "TooLarge": _error("The request body is larger than the server's limit."),
    "TooManyRequests": _error("A full queue, a tenant's rate limit, or the SLO monitor shedding traffic.", True),
    "ServerError": _error("The server or the engine failed on this request."),
    "BadGateway": _error("An upstream replica failed or could not be reached."),
    "Unavailable": _error("Not ready, shutting down, no upstream available, or shedding traffic.", True),
    "Error": _error("An error, in OpenAI's shape."),
}


def _errors(*statuses: int) -> dict[str, Any]:
    names = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 413: "TooLarge",
             429: "TooManyRequests", 500: "ServerError", 502: "BadGateway", 503: "Unavailable"}
    out: dict[str, Any] = {str(s): {"$ref": "#/components/responses/" + names[s]} for s in statuses}
    out["default"] = {"$ref": "#/components/responses/Error"}
    return out


_REQUEST_HEADERS = {
    "X-Request-ID": "the request's id (its record's key); one is made when absent or not a plain id",
    "X-Lane": "the lane asked for (honoured only where the key's tenant allows it, or from a trusted proxy)",
    "X-Business-Type": "the traffic's business type, for the SLO monitor's shedding and views",
    "X-Client": "the client, a slice of the SLO monitor's views",
    "X-Region": "the region, a slice of the SLO monitor's views",
    "X-Session-ID": "a gateway keeps a session on one replica (when the body has no `user`)",
}


def _header_params() -> list[dict[str, str]]:
    return [{"$ref": "#/components/parameters/" + name} for name in _REQUEST_HEADERS]


def _stream_description(chunk: str) -> str:
    return (f"`application/json`: the whole answer. `text/event-stream` (when `stream` is true): server-sent events, "
            f"each `data:` a `{chunk}` as JSON, ending with `data: [DONE]`; an error after the stream began is one "
            f"last `ErrorResponse` event before `[DONE]`; `: keep-alive` comments may come while the answer waits. "
            f"Headers: `X-Request-ID`, and `Server-Timing` (the stage times) on a whole answer.")


def _completion_op(chat: bool, gateway: bool) -> dict[str, Any]:
    answer, chunk = ("ChatCompletion", "ChatCompletionChunk") if chat else ("Completion", "CompletionChunk")
    request = ("GatewayChatRequest" if chat else "GatewayCompletionRequest") if gateway else \
        ("ChatRequest" if chat else "CompletionRequest")
    if gateway:
        how = ("The request passes through to an upstream replica: the gateway checks only `model`, `stream`, "
               "`stream_options`, the output limit, `n`, `priority` and `user`; the upstream validates the rest. "
               "What the upstream answers comes back as it wrote it (tool calls, reasoning text, logprobs, usage), "
               "under the gateway's id and model name.")
    else:
        how = ("Served by the embedded engine. The request is validated strictly: a wrong type or an unknown field "
               "is a 400, and an OpenAI parameter the engine does not implement is accepted only at its neutral "
               "value.")
    return {
        "operationId": "createChatCompletion" if chat else "createCompletion",
        "tags": ["inference"],
        "summary": "Create a chat completion" if chat else "Create a completion",
        "description": how,
        "parameters": _header_params(),
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {
                "description": _stream_description(chunk),
                "headers": {"X-Request-ID": {"$ref": "#/components/headers/X-Request-ID"},
                            "Server-Timing": {"$ref": "#/components/headers/Server-Timing"},
                            "X-Tailguard-Degraded": {"$ref": "#/components/headers/X-Tailguard-Degraded"}},
                "content": {
                    "application/json": {"schema": _ref(answer)},
                    "text/event-stream": {"schema": {"oneOf": [_ref(chunk), _ref("ErrorResponse")]}},
                },
            },
            **_errors(400, 401, 404, 413, 429, 500, *((502,) if gateway else ()), 503),
        },
    }


def _forward_op(path: str) -> dict[str, Any]:
    embeddings = path == "/v1/embeddings"
    content: dict[str, Any] = {"application/json": {"schema": _ref("EmbeddingList" if embeddings else "UpstreamAnswer")}}
    if not embeddings:
        content["text/event-stream"] = {"schema": {"type": "object", "additionalProperties": True,
                                                   "description": "each event's `data:`, as the upstream wrote it"}}
    return {
        "operationId": "createEmbeddings" if embeddings else "createResponse",
        "tags": ["inference"],
        "summary": "Create embeddings" if embeddings else "Create a model response (Responses API)",
        "description": ("Forwarded to an upstream replica as the client sent it, under the same keys, lanes, "
                        "admission and records as completions; its answer (status, body) comes back as the "
                        "replica wrote it."),
        "parameters": _header_params(),
        "requestBody": {"required": True, "content": _json("GatewayForwardRequest")},
        "responses": {"200": {"description": "The upstream's answer.", "content": content},
                      **_errors(400, 401, 404, 413, 429, 500, 502, 503)},
    }


def _get(op_id: str, summary: str, responses: dict[str, Any], *, tag: str, description: str | None = None,
         security: list[dict[str, list[str]]] | None = None, parameters: list[dict[str, Any]] | None = None
         ) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": op_id, "tags": [tag], "summary": summary}
    if description:
        op["description"] = description
    if parameters:
        op["parameters"] = parameters
    op["responses"] = responses
    if security is not None:
        op["security"] = security
    return op


_OPEN: list[dict[str, list[str]]] = []  # no key needed
_ADMIN: list[dict[str, list[str]]] = [{"adminKey": []}]
_OWNER: list[dict[str, list[str]]] = [{"apiKey": []}, {"adminKey": []}]


def _ok(description: str, media: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {media: {"schema": schema}}}


def _paths(gateway: bool) -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _completion_op(True, gateway)},
        "/v1/completions": {"post": _completion_op(False, gateway)},
    }
    if gateway:
        paths["/v1/responses"] = {"post": _forward_op("/v1/responses")}
        paths["/v1/embeddings"] = {"post": _forward_op("/v1/embeddings")}
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                   "description": "a served model name (it may contain `/`)"}
    paths["/v1/models"] = {"get": _get("listModels", "The model names clients may send", {
        "200": _ok("The served names.", "application/json", _ref("ModelList")), **_errors(401)}, tag="models")}
    paths["/v1/models/{model}"] = {"get": _get("retrieveModel", "One served model", {
        "200": _ok("The model.", "application/json", _ref("Model")), **_errors(401, 404)},
        tag="models", parameters=[model_param])}
    rid = {"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"},
           "description": "the request's `X-Request-ID`"}
    paths["/v1/requests/{request_id}"] = {"get": _get(
        "getRequestRecord", "One request's record", {
            "200": _ok("The record (the latest, where a client reused the id).", "application/json",
                       _ref("RequestRecord")), **_errors(401, 403, 404, 503)},
        tag="observability", parameters=[rid], security=_OWNER,
        description="The admin key reads any record; a client key only those it made (another's is a 404).")}
    alert_params = [
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 100}},
        {"name": "since", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 1e12},
         "description": "unix seconds"},
        {"name": "kind", "in": "query", "schema": {"type": "string", "enum": list(ALERT_KINDS)}},
    ]
    paths["/v1/alerts"] = {"get": _get("listAlerts", "The SLO monitor's records", {
        "200": _ok("The records.", "application/json", _ref("AlertList")), **_errors(400, 401, 403)},
        tag="observability", parameters=alert_params, security=_ADMIN)}
    paths["/health"] = {"get": _get("health", "Whether the process is alive", {
        "200": _ok("Alive.", "application/json", _ref("Health")),
        "503": _ok("The engine failed.", "application/json", _ref("Health"))}, tag="operations", security=_OPEN)}
    paths["/ready"] = {"get": _get("ready", "Whether requests can be served", {
        "200": _ok("Ready.", "application/json", _ref("Readiness")),
        "503": _ok("Loading, draining, failed, or (a gateway) no replica available.", "application/json",
                   _ref("Readiness"))}, tag="operations", security=_OPEN)}
    paths["/metrics"] = {"get": _get("metrics", "Prometheus metrics (docs/metrics.md)", {
        "200": _ok("The exposition text.", METRICS_CONTENT_TYPE.split(";")[0], {"type": "string"})},
        tag="operations", security=_OPEN)}
    paths["/slo"] = {"get": _get("sloPage", "The live SLO page", {
        "200": _ok("The page (it reads its data with the admin key from its URL fragment).", "text/html",
                   {"type": "string"}), **_errors(404)}, tag="observability", security=_OPEN)}
    paths["/openapi.json"] = {"get": _get("openapi", "This document", {
        "200": _ok("The OpenAPI document.", "application/json", {"type": "object"})}, tag="operations",
        security=_OPEN)}
    return paths


def _components(gateway: bool) -> dict[str, Any]:
    return {
        "schemas": _schemas(gateway),
        "responses": _ERRORS,
        "parameters": {name: {"name": name, "in": "header", "required": False, "schema": {"type": "string"},
                              "description": text} for name, text in _REQUEST_HEADERS.items()},
        "headers": {
            "X-Request-ID": {"description": "the request's id", "schema": {"type": "string"}},
            "Server-Timing": {"description": "the stage times (W3C Server-Timing, milliseconds)",
                              "schema": {"type": "string"}},
            "X-Tailguard-Degraded": {"description": "on a degraded answer: `<mode>; tier=<tier>; action=<id>`",
                                     "schema": {"type": "string"}},
            "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}},
        },
        "securitySchemes": {
            "apiKey": {"type": "http", "scheme": "bearer",
                       "description": "a client key (or the admin key); with no client key configured, the inference "
                                      "API is open"},
            "adminKey": {"type": "http", "scheme": "bearer", "description": "the admin key (--admin-key)"},
        },
    }


def _referenced(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(SCHEMAS):
            out.add(ref[len(SCHEMAS):])
        for value in node.values():
            _referenced(value, out)
    elif isinstance(node, list):
        for value in node:
            _referenced(value, out)


def _prune(doc: dict[str, Any]) -> None:
    """Drop the schemas nothing refers to (the closed parts a gateway's open components replaced)."""
    schemas = doc["components"]["schemas"]
    rest = {k: v for k, v in doc.items() if k != "components"}
    rest["components"] = {k: v for k, v in doc["components"].items() if k != "schemas"}
    todo: set[str] = set()
    _referenced(rest, todo)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in schemas:
            continue
        seen.add(name)
        _referenced(schemas[name], todo)
    doc["components"]["schemas"] = {k: v for k, v in schemas.items() if k in seen}


def build_document(gateway: bool) -> dict[str, Any]:
    """The document for a server over the embedded engine (``gateway`` false) or over upstream replicas."""
    mode = ("a gateway over upstream replicas: the OpenAI API passes through" if gateway
            else "the embedded engine: the OpenAI API, validated strictly")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "tailguard",
            "version": tailguard.__version__,
            "summary": "An OpenAI-compatible server that keeps the tail latency of LLM inference in check.",
            "description": f"This server is {mode}. Answers carry a `tailguard` object (the request's stage "
                           "times) and, when degraded by the SLO monitor, a `system_fingerprint` that says so.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "tags": [{"name": "inference"}, {"name": "models"}, {"name": "observability"}, {"name": "operations"}],
        "security": [{"apiKey": []}],
        "paths": _paths(gateway),
        "components": _components(gateway),
    }
    _prune(doc)
    return doc


@functools.cache
def document_bytes(gateway: bool) -> bytes:
    """The document as JSON, built once per mode."""
    return json.dumps(build_document(gateway), ensure_ascii=False).encode()
