"""``GET /openapi.json`` describes the API as served, in both modes: the document is valid OpenAPI 3.1, and real
answers (whole, every streamed chunk, errors) validate against the schemas it gives for their path and status. Our
own objects are closed in the document, so a field the server starts writing fails here until it is documented."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from openapi_spec_validator import validate as validate_spec
from referencing import Registry
from referencing.jsonschema import DRAFT202012

import tailguard
from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.serving.openapi import build_document, document_bytes
from tests.serving.test_gateway import gateway
from tests.serving.test_gateway_passthrough import TOOLS, scripted_upstream
from tests.serving.test_server_degraded import _go_red
from tests.serving_helpers import ADMIN, fake_server, settle
from tests.slo_helpers import FakeClock, slo_config, slo_server

KEY = "sk-openapi-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
URI = "urn:tailguard:openapi"
COMMON_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{model}", "/health", "/ready",
                "/metrics", "/v1/requests/{request_id}", "/v1/alerts", "/slo", "/openapi.json"}
GATEWAY_PATHS = {"/v1/responses", "/v1/embeddings"}
MESSAGES = [{"role": "user", "content": "hello there"}]


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


class Spec:
    """The served document, and the JSON schemas it gives for each operation's bodies."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.registry = Registry().with_resource(URI, DRAFT202012.create_resource(doc))

    def _validator(self, pointer: str) -> Draft202012Validator:
        return Draft202012Validator({"$ref": f"{URI}#{pointer}"}, registry=self.registry)

    def _follow(self, obj: dict[str, Any], pointer: str) -> tuple[dict[str, Any], str]:
        while "$ref" in obj:
            pointer = obj["$ref"].removeprefix("#")
            obj = self.doc
            for part in pointer.strip("/").split("/"):
                obj = obj[part.replace("~1", "/").replace("~0", "~")]
        return obj, pointer

    def response_pointer(self, path: str, method: str, status: int, media: str) -> str:
        op = self.doc["paths"][path][method]
        assert str(status) in op["responses"], f"{method.upper()} {path} documents no {status}"
        base = f"/paths/{_escape(path)}/{method}/responses/{status}"
        resp, base = self._follow(op["responses"][str(status)], base)
        assert media in resp["content"], f"{method.upper()} {path} {status} documents no {media}"
        return f"{base}/content/{_escape(media)}/schema"

    def check(self, instance: Any, path: str, method: str, status: int, media: str = "application/json") -> None:
        """``instance`` is valid against the schema the document gives for this answer."""
        validator = self._validator(self.response_pointer(path, method, status, media))
        err = best_match(validator.iter_errors(instance))
        assert err is None, f"{method.upper()} {path} {status}: {err.message} at {list(err.absolute_path)}\n" \
                            f"{json.dumps(instance)[:2000]}"

    def request_errors(self, body: Any, path: str) -> list[str]:
        content, pointer = self._follow(self.doc["paths"][path]["post"]["requestBody"],
                                        f"/paths/{_escape(path)}/post/requestBody")
        assert "application/json" in content["content"]
        validator = self._validator(f"{pointer}/content/application~1json/schema")
        return [e.message for e in validator.iter_errors(body)]

    def check_answer(self, r: httpx.Response, path: str, method: str = "get") -> Any:
        """The answer's status and body against the document; returns the body."""
        media = r.headers["content-type"].split(";")[0]
        if media == "text/event-stream":
            events = sse_events(r.text)
            for event in events:
                self.check(event, path, method, r.status_code, media)
            return events
        body = r.json()
        self.check(body, path, method, r.status_code, media)
        return body


def sse_events(text: str) -> list[dict[str, Any]]:
    """Every ``data:`` event of a stream as JSON; the stream must end with ``[DONE]``."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text[-500:]
    return [json.loads(d) for d in data[:-1]]


def walk_refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from walk_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk_refs(value)


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"a reference outside the document: {ref}"
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> Iterator[tuple[str, Spec]]:
    with fake_server(tmp_path_factory.mktemp("embedded"), FakeTiming(ttft=0.002, itl=0.0005), api_key=KEY) as s:
        r = httpx.get(s.url + "/openapi.json", timeout=30)  # no key needed, though the API has one
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
        yield s.url, Spec(r.json())


@pytest.fixture(scope="module")
def through(tmp_path_factory) -> Iterator[tuple[str, Spec]]:
    with scripted_upstream() as (url, _), gateway(tmp_path_factory.mktemp("gateway"), [url]) as gw:
        r = httpx.get(gw.url + "/openapi.json", timeout=30)
        assert r.status_code == 200, r.text
        yield gw.url, Spec(r.json())


def _post(url: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={**AUTH, **headers}, timeout=30)


# --- the document -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["embedded", "through"])
def test_the_document_is_valid_openapi_3_1(mode, request):
    _, spec = request.getfixturevalue(mode)
    doc = spec.doc
    validate_spec(doc)  # the OpenAPI 3.1 schema, and its own checks
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == tailguard.__version__
    assert {"openapi", "info", "paths", "components"} <= set(doc) and doc["info"]["title"]
    refs = set(walk_refs(doc))
    for ref in refs:
        resolve(doc, ref)
    for name, schema in doc["components"]["schemas"].items():
        Draft202012Validator.check_schema(schema)
        assert f"#/components/schemas/{name}" in refs, f"{name} is referred to by nothing"
    schemes = doc["components"]["securitySchemes"]
    assert schemes["apiKey"] == {**schemes["apiKey"], "type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"apiKey": []}] and doc["paths"]["/health"]["get"]["security"] == []
    expected = COMMON_PATHS | (GATEWAY_PATHS if mode == "through" else set())
    assert set(doc["paths"]) == expected
    for path, item in doc["paths"].items():
        for op in item.values():
            assert op["operationId"] and "200" in op["responses"], path


def test_the_embedded_request_schemas_are_the_validators_own(embedded):
    url, spec = embedded
    chat = "/v1/chat/completions"
    assert spec.doc["paths"][chat]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatRequest"}
    accepted = [
        {"model": "fake", "messages": MESSAGES, "max_tokens": 2},
        {"model": "fake", "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
         "max_completion_tokens": 2, "n": 1, "presence_penalty": 0, "tools": [], "seed": 3, "stop": ["x"]},
        {"model": "fake", "messages": MESSAGES, "max_tokens": 2, "stream": None, "ignore_eos": None, "n": None},
    ]
    refused = [
        {"model": "fake", "messages": MESSAGES, "bogus": 1},  # unknown field
        {"model": "fake", "messages": MESSAGES, "best_of": 2},  # not implemented, at a value that matters
        {"model": "fake", "messages": MESSAGES, "n": 17},  # more choices than one request may ask for
        {"model": "fake", "messages": MESSAGES, "temperature": 3.0},
        {"model": "fake", "messages": [{"role": "robot", "content": "x"}]},
        {"model": "fake"},
        {"model": "fake", "messages": None},
        {"model": "fake", "messages": MESSAGES, "stream_options": {"include_usage": None}, "stream": True},
    ]
    for body in accepted:
        assert spec.request_errors(body, chat) == [], body
        assert _post(url, chat, body).status_code == 200, body
    for body in refused:
        assert spec.request_errors(body, chat), body
        r = _post(url, chat, body)
        assert r.status_code == 400, body
        spec.check_answer(r, chat, "post")
    assert spec.request_errors({"model": "fake", "prompt": [1, 2, 3], "logprobs": 2}, "/v1/completions") == []
    assert spec.request_errors({"model": "fake", "prompt": "x", "logprobs": True}, "/v1/completions")


def test_a_field_the_document_does_not_have_fails(embedded, through):
    """What makes this worth having: our own objects are closed, so a new field must be documented."""
    url, spec = embedded
    body = _post(url, "/v1/chat/completions", {"model": "fake", "messages": MESSAGES, "max_tokens": 2}).json()
    spec.check(body, "/v1/chat/completions", "post", 200)
    for where in (body, body["choices"][0], body["choices"][0]["message"], body["usage"], body["tailguard"],
                  body["tailguard"]["stages"]):
        where["not_documented"] = 1
        with pytest.raises(AssertionError, match=r"Additional properties are not allowed \(.not_documented"):
            spec.check(body, "/v1/chat/completions", "post", 200)
        del where["not_documented"]
    chunk = sse_events(_post(url, "/v1/chat/completions", {"model": "fake", "messages": MESSAGES, "max_tokens": 2,
                                                           "stream": True}).text)[1]
    chunk["choices"][0]["delta"]["not_documented"] = 1
    with pytest.raises(AssertionError):
        spec.check(chunk, "/v1/chat/completions", "post", 200, "text/event-stream")
    # Through the gateway a delta is the upstream's (open), but the chunk around it is still ours.
    gw_url, gw_spec = through
    chunk = sse_events(_post(gw_url, "/v1/chat/completions", {"model": "fake", "messages": MESSAGES, "max_tokens": 2,
                                                              "stream": True}).text)[1]
    chunk["choices"][0]["delta"]["upstream_field"] = 1
    gw_spec.check(chunk, "/v1/chat/completions", "post", 200, "text/event-stream")
    chunk["not_documented"] = 1
    with pytest.raises(AssertionError):
        gw_spec.check(chunk, "/v1/chat/completions", "post", 200, "text/event-stream")


def test_the_document_is_built_once_and_served_without_a_key(embedded):
    url, spec = embedded
    a = httpx.get(url + "/openapi.json", timeout=30)
    b = httpx.get(url + "/openapi.json", timeout=30)
    assert a.status_code == 200 and a.content == b.content and a.json() == spec.doc
    assert build_document(False) == spec.doc and a.content == document_bytes(False)


# --- embedded mode: real answers against the document ---------------------------------------------------------------


def test_embedded_chat_answers_match_the_document(embedded):
    url, spec = embedded
    chat = "/v1/chat/completions"
    body = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 4}), chat, "post")
    assert body["object"] == "chat.completion" and body["tailguard"]["output_tokens"] == 4
    with_lp = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 3,
                                                  "logprobs": True, "top_logprobs": 2}), chat, "post")
    assert len(with_lp["choices"][0]["logprobs"]["content"]) == 3
    for extra in ({}, {"stream_options": {"include_usage": True}}, {"logprobs": True, "top_logprobs": 1}):
        r = _post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 4, "stream": True, **extra})
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = spec.check_answer(r, chat, "post")  # every chunk
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and "tailguard" in chunks[-1]
        assert ("usage" in chunks[-1]) == bool(extra.get("stream_options"))


def test_embedded_completion_answers_match_the_document(embedded):
    url, spec = embedded
    path = "/v1/completions"
    body = spec.check_answer(_post(url, path, {"model": "fake", "prompt": "hi", "max_tokens": 3}), path, "post")
    assert body["object"] == "text_completion"
    spec.check_answer(_post(url, path, {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 2}),
                      path, "post")
    for extra in ({}, {"stream_options": {"include_usage": True}}, {"logprobs": 1}):
        r = _post(url, path, {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True, **extra})
        chunks = spec.check_answer(r, path, "post")
        assert chunks and "tailguard" in chunks[-1]


def test_embedded_errors_match_the_document(embedded):
    url, spec = embedded
    chat = "/v1/chat/completions"
    r = _post(url, chat, {"model": "fake", "messages": []})
    assert r.status_code == 400 and spec.check_answer(r, chat, "post")["error"]["param"] == "messages"
    r = _post(url, chat, {"model": "nope", "messages": MESSAGES})
    assert r.status_code == 404 and spec.check_answer(r, chat, "post")["error"]["code"] == "model_not_found"
    r = _post(url, "/v1/completions", {"model": "fake", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and spec.check_answer(r, "/v1/completions", "post")
    r = httpx.post(url + chat, json={"model": "fake", "messages": MESSAGES}, timeout=30)  # no key
    assert r.status_code == 401 and spec.check_answer(r, chat, "post")
    r = httpx.get(url + "/v1/models/nope", headers=AUTH, timeout=30)
    assert r.status_code == 404 and spec.check_answer(r, "/v1/models/{model}")
    r = httpx.get(url + "/v1/alerts", headers=AUTH, timeout=30)  # a client key on an admin surface
    assert r.status_code == 403 and spec.check_answer(r, "/v1/alerts")
    r = httpx.get(url + "/v1/alerts?limit=0", headers=ADMIN, timeout=30)
    assert r.status_code == 400 and spec.check_answer(r, "/v1/alerts")
    r = httpx.get(url + "/v1/requests/never-made", headers=ADMIN, timeout=30)
    assert r.status_code == 404 and spec.check_answer(r, "/v1/requests/{request_id}")


def test_embedded_models_and_operations_match_the_document(embedded):
    url, spec = embedded
    models = spec.check_answer(httpx.get(url + "/v1/models", headers=AUTH, timeout=30), "/v1/models")
    assert [m["id"] for m in models["data"]] == ["fake"]
    spec.check_answer(httpx.get(url + "/v1/models/fake", headers=AUTH, timeout=30), "/v1/models/{model}")
    spec.check_answer(httpx.get(url + "/health", timeout=30), "/health")
    spec.check_answer(httpx.get(url + "/ready", timeout=30), "/ready")
    alerts = spec.check_answer(httpx.get(url + "/v1/alerts", headers=ADMIN, timeout=30), "/v1/alerts")
    assert alerts["object"] == "list"
    r = _post(url, "/v1/chat/completions", {"model": "fake", "messages": MESSAGES, "max_tokens": 2},
              **{"X-Request-ID": "openapi-record-1"})
    assert r.status_code == 200
    spec.check_answer(httpx.get(url + "/v1/requests/openapi-record-1", headers=ADMIN, timeout=30),
                      "/v1/requests/{request_id}")
    metrics = httpx.get(url + "/metrics", timeout=30)
    spec.response_pointer("/metrics", "get", 200, metrics.headers["content-type"].split(";")[0])
    page = httpx.get(url + "/slo", timeout=30)
    spec.response_pointer("/slo", "get", page.status_code, page.headers["content-type"].split(";")[0])


def test_a_degraded_answer_matches_the_document(tmp_path):
    """``system_fingerprint`` and ``tailguard.degraded``, on a template answer and a truncated one."""
    for actions in ({"mode": "template", "template": "Busy.", "probe_every": 0},
                    {"mode": "truncate", "max_tokens": 2, "probe_every": 0}):
        clock, engine = FakeClock(), FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
        sub = tmp_path / actions["mode"]
        sub.mkdir()
        with slo_server(sub, clock, slo_config(actions={"degrade": actions}), engine) as server:
            spec = Spec(httpx.get(server.url + "/openapi.json", timeout=30).json())
            _go_red(server, clock, engine)
            chat = "/v1/chat/completions"
            body = spec.check_answer(httpx.post(server.url + chat, json={
                "model": "fake", "messages": MESSAGES, "max_tokens": 8}, timeout=30), chat, "post")
            assert body["system_fingerprint"] == f"tailguard-degraded:{actions['mode']}"
            assert body["tailguard"]["degraded"]["mode"] == actions["mode"]
            chunks = spec.check_answer(httpx.post(server.url + chat, json={
                "model": "fake", "messages": MESSAGES, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}, timeout=30), chat, "post")
            assert chunks[-1]["tailguard"]["degraded"]["mode"] == actions["mode"]
            spec.check_answer(httpx.post(server.url + "/v1/completions", json={
                "model": "fake", "prompt": "hello", "max_tokens": 8}, timeout=30), "/v1/completions", "post")
            settle(server)


# --- gateway mode ---------------------------------------------------------------------------------------------------


def test_gateway_request_schemas_check_only_what_the_gateway_checks(through):
    url, spec = through
    chat = "/v1/chat/completions"
    assert spec.doc["paths"][chat]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/GatewayChatRequest"}
    passed = {"model": "fake", "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, "repetition_penalty": 1.1,
              "chat_template_kwargs": {"enable_thinking": False}}
    assert spec.request_errors(passed, chat) == []
    assert _post(url, chat, passed).status_code == 200
    for body in ({"model": "fake", "messages": []}, {"messages": MESSAGES},
                 {"model": "fake", "messages": MESSAGES, "max_tokens": 0},
                 {"model": "fake", "messages": MESSAGES, "n": 17}):
        assert spec.request_errors(body, chat), body
        r = _post(url, chat, body)
        assert r.status_code == 400, body
        spec.check_answer(r, chat, "post")
    assert spec.request_errors({"model": "fake", "input": "x", "dimensions": 3}, "/v1/embeddings") == []
    assert spec.request_errors({"input": "x"}, "/v1/embeddings")


def test_gateway_answers_match_the_document(through):
    url, spec = through
    chat = "/v1/chat/completions"
    body = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 4,
                                               "logprobs": True}), chat, "post")
    assert body["choices"][0]["message"]["content"] == "Hi there"
    chunks = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 4,
                                                 "stream": True, "stream_options": {"include_usage": True}}),
                               chat, "post")
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    reasoning = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 4,
                                                    "reasoning_effort": "low"}), chat, "post")
    assert reasoning["choices"][0]["message"]["reasoning_content"] == "The user greets."
    path = "/v1/completions"
    spec.check_answer(_post(url, path, {"model": "fake", "prompt": "hi", "max_tokens": 3}), path, "post")
    spec.check_answer(_post(url, path, {"model": "fake", "prompt": "hi", "max_tokens": 3, "stream": True}), path,
                      "post")


def test_gateway_tool_calls_match_the_document(through):
    url, spec = through
    chat = "/v1/chat/completions"
    body = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 32,
                                               "tools": TOOLS}), chat, "post")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["id"] == "call_1"
    chunks = spec.check_answer(_post(url, chat, {"model": "fake", "messages": MESSAGES, "max_tokens": 32,
                                                 "tools": TOOLS, "stream": True}), chat, "post")
    calls = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or ()]
    assert len(calls) == 4 and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_gateway_forwarded_answers_and_errors_match_the_document(through):
    url, spec = through
    emb = spec.check_answer(_post(url, "/v1/embeddings", {"model": "fake", "input": "hello"}), "/v1/embeddings",
                            "post")
    assert emb["data"][0]["embedding"] == [0.25, -0.5, 1.0]
    spec.check_answer(_post(url, "/v1/responses", {"model": "fake", "input": "hi"}), "/v1/responses", "post")
    r = _post(url, "/v1/embeddings", {"model": "nope", "input": "x"})
    assert r.status_code == 404 and spec.check_answer(r, "/v1/embeddings", "post")
    r = _post(url, "/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    assert r.status_code == 404 and spec.check_answer(r, "/v1/chat/completions", "post")
    models = spec.check_answer(httpx.get(url + "/v1/models", timeout=30), "/v1/models")
    assert [m["id"] for m in models["data"]] == ["fake"]
    spec.check_answer(httpx.get(url + "/v1/models/nope", timeout=30), "/v1/models/{model}")
    spec.check_answer(httpx.get(url + "/ready", timeout=30), "/ready")
