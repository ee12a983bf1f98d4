"""The gateway passes the OpenAI API through: every field a client sends reaches the upstream unchanged (but the
gateway's own), and what the upstream answers comes back unchanged, streamed or not: tool calls, reasoning text,
logprobs, usage with its details. Driven with the official ``openai`` client against a scripted upstream that
answers the way vLLM does."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.net import free_port
from tests.serving.test_gateway import gateway
from tests.serving_helpers import settle

CALL_ARGS = '{"city": "Paris", "unit": "celsius"}'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
                   "required": ["city"]}}}]


def _chunk(delta: dict | None, finish: str | None = None, logprobs: Any = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    out: dict[str, Any] = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "up",
                           "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def _script(body: dict) -> list[dict]:
    """vLLM's stream for the request: tool-call deltas, reasoning deltas, or content with logprobs."""
    usage = {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26,
             "prompt_tokens_details": {"cached_tokens": 16}}
    if body.get("tools"):
        head = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        pieces = [CALL_ARGS[:10], CALL_ARGS[10:25], CALL_ARGS[25:]]
        return [_chunk({"role": "assistant", "content": ""}), _chunk({"tool_calls": [head]}),
                *[_chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}) for p in pieces],
                _chunk({}, "tool_calls"), _chunk(None, usage=usage)]
    if body.get("reasoning_effort"):
        return [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "The user"}),
                _chunk({"reasoning_content": " greets."}), _chunk({"content": "Hello"}), _chunk({"content": "!"}),
                _chunk({}, "stop"), _chunk(None, usage=usage)]
    lp = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in ("Hi", " there")]
    return [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}, logprobs={"content": lp[:1]}),
            _chunk({"content": " there"}, logprobs={"content": lp[1:]}), _chunk({}, "stop"), _chunk(None, usage=usage)]


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received: list[dict] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        models = {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "vllm"}]}
        if self.path == "/v1/models":
            self._send(200, json.dumps(models).encode(), "application/json")
        else:
            self._send(200, b"", "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).received.append(body)
        if self.path == "/v1/embeddings":
            out = {"object": "list", "model": "up", "data": [{"object": "embedding", "index": 0,
                                                              "embedding": [0.25, -0.5, 1.0]}],
                   "usage": {"prompt_tokens": 2, "total_tokens": 2}}
            self._send(200, json.dumps(out).encode(), "application/json")
            return
        if self.path == "/v1/responses":
            if body.get("stream"):
                events = [{"type": "response.created"}, {"type": "response.output_text.delta", "delta": "Hi"},
                          {"type": "response.completed"}]
                sse = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
                self._send(200, sse, "text/event-stream")
            else:
                out = {"id": "resp_1", "object": "response", "status": "completed", "model": "up", "output": [
                    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}]}
                self._send(200, json.dumps(out).encode(), "application/json")
            return
        events = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in _script(body)) + b"data: [DONE]\n\n"
        self._send(200, events, "text/event-stream")


@contextlib.contextmanager
def scripted_upstream() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []
    handler = type("Upstream", (_Upstream,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def through(tmp_path: Path):
    with scripted_upstream() as (url, received), gateway(tmp_path, [url]) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        yield client, received, gw


def test_every_field_reaches_the_upstream_unchanged_but_the_gateways_own(through):
    client, received, _ = through
    extra = {"logit_bias": {"50256": -100}, "presence_penalty": 0.5, "frequency_penalty": 0.2, "n": 1,
             "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
             "metadata": {"team": "a"}, "service_tier": "default", "parallel_tool_calls": False,
             "chat_template_kwargs": {"enable_thinking": False}, "guided_json": {"type": "object"},
             "repetition_penalty": 1.1, "speculative": False}
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                   extra_body=extra)
    sent = received[-1]
    for key, value in extra.items():
        if key == "speculative":
            assert key not in sent  # tailguard's own field stays here
        else:
            assert sent[key] == value, key
    assert sent["max_tokens"] == 8 and sent["stream"] is True  # streamed upstream, so that every token is timed


def test_tool_calls_come_back_whole_when_not_streamed(through):
    client, received, gw = through
    r = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
        tool_choice="required", max_tokens=32)
    out = r.parse()
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.id == "call_1" and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(CALL_ARGS)
    assert received[-1]["tools"] == TOOLS and received[-1]["tool_choice"] == "required"
    assert out.usage.prompt_tokens_details.cached_tokens == 16 and out.usage.completion_tokens == 5
    settle(gw)
    rec = gw.state.store.get(r.headers["x-request-id"])
    assert rec["finish_reason"] == "tool_calls" and rec["ttft"] is not None and rec["ttft"] > 0  # a tool call first


def test_tool_calls_stream_as_the_upstream_sent_them(through):
    client, received, _ = through
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "weather?"}],
                                            tools=TOOLS, tool_choice=named, max_tokens=32, stream=True)
    args, names, finish = [], [], None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                names += [tc.function.name] if tc.function and tc.function.name else []
                args += [tc.function.arguments] if tc.function and tc.function.arguments else []
            finish = ch.finish_reason or finish
    assert names == ["get_weather"] and json.loads("".join(args)) == json.loads(CALL_ARGS)
    assert finish == "tool_calls" and received[-1]["tool_choice"] == named


def test_reasoning_is_passed_on_and_counted_apart(through):
    client, _, gw = through
    r = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True,
        extra_body={"reasoning_effort": "low"})
    reasoning, content = [], []
    for chunk in r.parse():
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            reasoning += [extra["reasoning_content"]] if extra.get("reasoning_content") else []
            content += [ch.delta.content] if ch.delta.content else []
    assert "".join(reasoning) == "The user greets." and "".join(content) == "Hello!"
    settle(gw)
    rec = gw.state.store.get(r.headers["x-request-id"])
    assert rec["gateway"]["reasoning_tokens"] == 2  # the reasoning's tokens, apart from the answer's


def test_logprobs_through_the_gateway(through):
    client, _, _ = through
    out = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         logprobs=True, top_logprobs=0)
    assert out.choices[0].message.content == "Hi there"
    assert [t.token for t in out.choices[0].logprobs.content] == ["Hi", " there"]
    chunks = list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, logprobs=True, stream=True))
    streamed = [t.token for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or ()]
    assert streamed == ["Hi", " there"]


def test_what_the_gateway_acts_on_is_still_checked(through):
    client, received, _ = through
    before = len(received)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake", messages=[], max_tokens=4)
    assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert err.value.body["param"] == "max_tokens" and len(received) == before  # refused here, never sent on
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], n=0)
    assert err.value.body["param"] == "n" and len(received) == before


def test_a_plain_token_that_mentions_a_passed_on_field_stays_plain():
    """The cheap check sees the bytes of a field name; the parse decides: inside the text they are just text."""
    from tailguard.backends.upstream.sse import read_chunk, token_text

    plain = json.dumps(_chunk({"content": 'say "tool_calls"'})).encode()
    assert token_text(plain, True) == 'say "tool_calls"' and read_chunk(plain, True).passthrough is None
    call = json.dumps(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})).encode()
    assert token_text(call, True) is None and read_chunk(call, True).passthrough == {
        "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "logprobs": None}
    with_lp = json.dumps(_chunk({"content": "x"}, logprobs={"content": []})).encode()
    assert token_text(with_lp, True) is None  # an empty list is still the upstream's to pass on


def test_tool_call_deltas_are_put_back_together_by_index():
    from tailguard.serving.passthrough import Reassembly

    r = Reassembly()
    r.add({"delta": {"tool_calls": [{"index": 1, "id": "b", "type": "function",
                                     "function": {"name": "g", "arguments": "{"}}]}})
    r.add({"delta": {"tool_calls": [{"index": 0, "id": "a", "type": "function",
                                     "function": {"name": "f", "arguments": "{}"}}]}})
    r.add({"delta": {"tool_calls": [{"index": 1, "function": {"arguments": "}"}}], "reasoning_content": "x"}})
    r.add({"delta": {"reasoning_content": "y"}, "logprobs": {"content": [1]}})
    r.add({"delta": None, "logprobs": {"content": [2]}})
    assert r.message_fields() == {"reasoning_content": "xy", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    assert r.logprobs == {"content": [1, 2]}


def test_embeddings_and_responses_are_forwarded_under_the_same_keys_and_records(through):
    client, received, gw = through
    emb = client.embeddings.with_raw_response.create(model="fake", input="hello world")
    assert emb.parse().data[0].embedding == [0.25, -0.5, 1.0] and received[-1]["input"] == "hello world"
    resp = client.responses.create(model="fake", input="hi", max_output_tokens=16)
    assert resp.output_text == "Hi" and received[-1]["max_output_tokens"] == 16
    events = [e.type for e in client.responses.create(model="fake", input="hi", stream=True)]
    assert events == ["response.created", "response.output_text.delta", "response.completed"]
    settle(gw)
    rec = gw.state.store.get(emb.headers["x-request-id"])
    assert rec["endpoint"] == "/v1/embeddings" and rec["status"] == 200 and rec["ttft"] is not None
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="x")


def test_the_embedded_engine_says_where_embeddings_are_served(tmp_path):
    from tests.serving_helpers import fake_server

    with fake_server(tmp_path) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError) as err:
            client.embeddings.create(model="fake", input="x")
    assert err.value.body["code"] == "not_a_gateway"


def test_several_choices_are_asked_one_each_and_answered_together(through):
    client, received, gw = through
    before = len(received)
    r = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3, seed=10, logprobs=True)
    out = r.parse()
    asked = received[before:]
    assert sorted(b["seed"] for b in asked) == [10, 11, 12]
    assert all("n" not in b for b in asked)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content == "Hi there" and c.finish_reason == "stop" for c in out.choices)
    assert all([t.token for t in c.logprobs.content] == ["Hi", " there"] for c in out.choices)
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens == 21
    settle(gw)
    assert gw.state.store.get(r.headers["x-request-id"])["output_tokens"] == 15

    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    calls: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "w?"}],
                                                tools=TOOLS, max_tokens=32, n=2, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            for tc in ch.delta.tool_calls or ():
                calls[ch.index] = calls.get(ch.index, "") + (tc.function.arguments or "")
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert finished == {0: "tool_calls", 1: "tool_calls"}
    assert all(json.loads(calls[i]) == json.loads(CALL_ARGS) for i in (0, 1))


def test_best_of_other_than_n_is_refused_by_name(through):
    client, _, _ = through
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake", prompt="hi", max_tokens=4, n=2, best_of=3)
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], n=17)
    assert err.value.body["param"] == "n"
