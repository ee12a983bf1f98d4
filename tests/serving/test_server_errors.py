"""Every error returns its status and OpenAI's error shape; no input crashes or hangs the server."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import openai
import pytest

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.sequence import RequestError
from tests.serving_helpers import ADMIN, fake_server, settle

CHAT = "/v1/chat/completions"
OK = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with fake_server(tmp_path_factory.mktemp("errors"), FakeTiming(ttft=0.002, itl=0.001), max_body_bytes=200_000) as s:
        yield s


def _post(server, body, path=CHAT, **kw) -> httpx.Response:
    if isinstance(body, dict | list):
        kw["json"] = body
    else:
        kw["content"] = body
        kw.setdefault("headers", {"content-type": "application/json"})
    return httpx.post(server.url + path, timeout=10, **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "any":
        assert err["param"] == param
    if code != "any":
        assert err["code"] == code
    assert "Traceback" not in r.text
    assert r.headers.get("x-request-id")
    return err


@pytest.mark.parametrize("body", [b"{bad json", b"", b"[1, 2]", b'"text"', b"\xff\xfe\x00garbage",
                                  b"[" * 50_000 + b"]" * 50_000, b'{"model": "fake", "messages": NaN}'])
def test_malformed_json_is_400(server, body):
    _assert_error(_post(server, body), 400)


@pytest.mark.parametrize("patch,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 2**70}, "seed"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ({"model": 7}, "model"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to str.isdigit(), not to int()
    ({"logit_bias": {"--5": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
])
def test_wrong_types_and_values_are_400(server, patch, param):
    _assert_error(_post(server, {**OK, **patch}), 400, param=param)


@pytest.mark.parametrize("patch,param", [({"best_of": 2}, "best_of"), ({"functions": [{"name": "f"}]}, "functions"),
                                         ({"audio": {"voice": "alloy"}}, "audio")])
def test_unsupported_parameters_are_refused_not_ignored(server, patch, param):
    err = _assert_error(_post(server, {**OK, **patch}), 400, param=param, code="unsupported_parameter")
    assert param in err["message"]


def test_neutral_values_of_unsupported_parameters_pass(server):
    r = _post(server, {**OK, "n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": None})
    assert r.status_code == 200


def test_unknown_argument_is_400(server):
    _assert_error(_post(server, {**OK, "temperatur": 0.5}), 400, param="temperatur", code="unrecognized_argument")


def test_lone_surrogate_in_the_prompt_is_a_plain_400(server):
    body = b'{"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    err = _assert_error(_post(server, body), 400, param="messages")
    assert "lone surrogate \\ud800" in err["message"] and "Error" not in err["message"]


@pytest.mark.parametrize("body,param", [
    (b'{"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}',
     "stop"),
    (b'{"model": "fake\\ud800", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "fake", "user\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}', "user\\ud800"),
])
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_its_field(server, body, param):
    err = _assert_error(_post(server, body), 400, param=param)
    assert "lone surrogate \\ud" in err["message"] or "lone surrogate \\udc" in err["message"]
    ok = b'{"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert _post(server, ok).status_code == 200  # a surrogate pair is an emoji: fine


def test_a_tool_calls_arguments_nested_past_the_parsers_depth_are_kept_as_text(server):
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert _post(server, {**OK, "messages": history}).status_code == 200


@pytest.mark.parametrize("body,path,param", [
    ({"model": "fake", "prompt": [5] * 20_000, "max_tokens": 1}, "/v1/completions", "prompt"),
    ({"model": "fake", "prompt": [[5] * 20_000], "max_tokens": 1}, "/v1/completions", "prompt"),
    ({**OK, "messages": [{"role": "user"}] * 9000}, CHAT, "messages"),  # (this server takes 200 KB bodies)
    ({**OK, "messages": [{"role": "user", "content": [{}] * 9000}]}, CHAT, "messages"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {} for i in range(4200)}}}}] * 2}, CHAT, "tools"),
])
def test_lists_that_cannot_fit_the_context_window_are_refused_before_validation(server, body, path, param):
    err = _assert_error(_post(server, body, path=path), 400, param=param, code="context_length_exceeded")
    assert "8,192" in err["message"]


def test_unknown_model_is_404(server):
    err = _assert_error(_post(server, {**OK, "model": "gpt-17"}), 404, param="model", code="model_not_found")
    assert "gpt-17" in err["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])


def test_prompt_over_context_window_is_400_with_token_counts(server):
    err = _assert_error(_post(server, {**OK, "max_tokens": 9000}), 400, code="context_length_exceeded")
    assert "9000" in err["message"] and "8192" in err["message"]
    long_prompt = {"model": "fake", "prompt": "x" * 5000, "max_tokens": 1}  # tokenized off the event loop
    ok = _post(server, long_prompt, path="/v1/completions")
    assert ok.status_code == 200
    err = _assert_error(_post(server, {"model": "fake", "prompt": [[5] * 8192], "max_tokens": 1},
                              path="/v1/completions"), 400)
    assert "8192" in err["message"]


def test_completions_specific_errors(server):
    _assert_error(_post(server, {"model": "fake", "prompt": ["a", "b"]}, path="/v1/completions"), 400,
                  param="prompt")
    _assert_error(_post(server, {"model": "fake", "prompt": [999999]}, path="/v1/completions"), 400, param="prompt")
    _assert_error(_post(server, {"model": "fake", "prompt": "x", "echo": True}, path="/v1/completions"), 400,
                  param="echo")
    _assert_error(_post(server, {"model": "fake", "prompt": ""}, path="/v1/completions"), 400)


def test_body_too_large_is_413(server):
    _assert_error(_post(server, {**OK, "messages": [{"role": "user", "content": "x" * 300_000}]}), 413)


def test_routes_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + CHAT)
    assert r.status_code == 405 and "error" in r.json()


def test_queue_full_is_429_with_retry_after(tmp_path):
    async def main(url: str, state) -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            first = asyncio.create_task(c.post(CHAT, json={**OK, "max_tokens": 1}))
            while state.admission.depth < 1:  # the first request holds the only place in the queue
                await asyncio.sleep(0.005)
            second = await c.post(CHAT, json=OK)
            return await first, second

    with fake_server(tmp_path, FakeTiming(ttft=0.5, itl=0.001), max_queue=1) as s:
        first, second = asyncio.run(main(s.url, s.state))
        assert first.status_code == 200
        err = _assert_error(second, 429, code="queue_full")
        assert 1 <= int(second.headers["retry-after"]) <= 60
        assert "queue" in err["message"]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(**OK).choices[0].finish_reason == "length"  # room again
        settle(s)
        outcomes = sorted(r[0] for r in s.state.store.query("SELECT outcome FROM requests"))
        assert outcomes == ["rejected", "success", "success"]


class _BrokenEngine(FakeEngine):
    """Fails inside generation, before or after the first token, with a message that must not leak."""

    def __init__(self, after: int, error: Exception | None = None) -> None:
        super().__init__(FakeTiming(ttft=0.001, itl=0.001))
        self.after = after
        self.failure = error or RuntimeError("SECRET internal detail /etc/passwd")

    async def generate(self, prompt_token_ids, sampling, request_id, priority=0, arrival_time=None):
        n = 0
        async for ev in super().generate(prompt_token_ids, sampling, request_id, priority, arrival_time):
            if n >= self.after:
                raise self.failure
            n += 1
            yield ev


def test_internal_failure_is_500_with_request_id_and_no_trace(tmp_path, caplog):
    with fake_server(tmp_path, engine=_BrokenEngine(after=0)) as s:
        with caplog.at_level(logging.ERROR, logger="tailguard"):
            r = _post(s, OK, headers={"X-Request-ID": "boom-1"})
        err = _assert_error(r, 500)
        assert "boom-1" in err["message"] and "SECRET" not in r.text
        assert "SECRET" in caplog.text  # the detail goes to the server's log, not to the client
        assert httpx.get(s.url + "/health").status_code == 200
        settle(s)
        rec = httpx.get(s.url + "/v1/requests/boom-1", headers=ADMIN).json()
        assert rec["status"] == 500 and rec["outcome"] == "error"


def test_failure_mid_stream_ends_the_stream_with_an_error_event(tmp_path):
    with fake_server(tmp_path, engine=_BrokenEngine(after=3)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIError) as info:
            list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=10, stream=True))
        assert "SECRET" not in str(info.value)


def test_request_error_mid_stream_still_ends_the_stream(tmp_path):
    """The engine refuses the request (the client's fault) after tokens went out: the status cannot change any more,
    so the stream must end with an error event and [DONE], not be cut off with an unterminated chunked body."""
    with fake_server(tmp_path, engine=_BrokenEngine(after=3, error=RequestError("refused mid-stream"))) as s:
        body = {**OK, "max_tokens": 10, "stream": True}
        with httpx.stream("POST", s.url + CHAT, json=body, headers={"X-Request-ID": "mid-1"}, timeout=10) as r:
            assert r.status_code == 200
            text = r.read().decode()
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "refused mid-stream" in err["message"] and err["type"] == "invalid_request_error"
        settle(s)
        rec = httpx.get(s.url + "/v1/requests/mid-1", headers=ADMIN).json()
        assert rec["status"] == 400 and rec["outcome"] == "invalid"
        assert httpx.get(s.url + "/health").status_code == 200


def test_api_key_required_and_never_logged(tmp_path, caplog):
    key = "sk-very-secret-key-123"
    with caplog.at_level(logging.DEBUG), fake_server(tmp_path, api_key=key) as s:
        _assert_error(_post(s, OK), 401, code="invalid_api_key")
        _assert_error(_post(s, OK, headers={"Authorization": "Bearer wrong"}), 401)
        assert _post(s, OK, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(**OK).usage.completion_tokens == 2
    assert key not in caplog.text


def test_fuzzed_bodies_never_crash_or_hang(server):
    rng = random.Random(1234)
    values = [None, True, 0, -1, 1.5, 2**65, "", "x", "你好", "\ud800", [], [1], [[1]], {}, {"a": 1},
              [{"role": "user"}], [{"role": "user", "content": None}], [{"role": "user", "content": "\u0000"}]]
    keys = list(OK) + ["prompt", "stream", "stop", "seed", "top_p", "logprobs", "top_logprobs", "stream_options"]
    statuses = set()
    for _ in range(60):
        body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
        if rng.random() < 0.5:
            body["model"] = "fake"
        path = CHAT if rng.random() < 0.7 else "/v1/completions"
        r = _post(server, json.dumps(body).encode(), path=path)
        statuses.add(r.status_code)
        assert r.status_code in (200, 400, 404), r.text
        if r.status_code != 200:
            _assert_error(r, r.status_code)
    assert 400 in statuses
    assert httpx.get(server.url + "/health").status_code == 200


def test_every_request_leaves_exactly_one_record(tmp_path):
    with fake_server(tmp_path) as s:
        ids = []
        for i, body in enumerate([OK, {**OK, "model": "nope"}, b"{", {**OK, "n": 17}, {**OK, "max_tokens": 10**6}]):
            rid = f"once-{i}"
            ids.append(rid)
            _post(s, body, headers={"X-Request-ID": rid, "content-type": "application/json"})
        settle(s)
        rows = s.state.store.query("SELECT request_id, status FROM requests ORDER BY id")
        assert [r[0] for r in rows] == ids
        assert [r[1] for r in rows] == [200, 404, 400, 400, 400]


def test_unhandled_route_error_echoes_only_a_valid_request_id(tmp_path, monkeypatch):
    with fake_server(tmp_path) as s:
        def broken(rid):
            raise RuntimeError("SECRET store detail")

        monkeypatch.setattr(s.state.store, "get", broken)
        r = httpx.get(s.url + "/v1/requests/x", headers={"X-Request-ID": "<script>alert(1)</script>", **ADMIN}, timeout=10)
        assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
        assert "<script>" not in r.json()["error"]["message"] and "SECRET" not in r.text
        r = httpx.get(s.url + "/v1/requests/x", headers={"X-Request-ID": "ok-id-1", **ADMIN}, timeout=10)
        assert r.status_code == 500 and "ok-id-1" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200


def test_a_path_without_its_trailing_slash_is_not_redirected_to_the_clients_host(server):
    r = httpx.get(server.url + "/v1/requests", headers={"Host": "evil.example"}, timeout=10, follow_redirects=False)
    assert r.status_code == 404 and "evil.example" not in r.headers.get("location", "")
    assert r.headers["content-type"].startswith("application/json") and r.json()["error"]["message"]
