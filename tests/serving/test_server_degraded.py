"""A degraded answer (the SLO monitor's red action) is visible in the OpenAI-shaped body itself, and its usage
counts what the model really produced."""

from __future__ import annotations

import json

import httpx
import openai

from tailguard.engine.fake import FakeEngine, FakeTiming
from tests.serving_helpers import settle
from tests.slo_helpers import FakeClock, burst, slo_config, slo_server

TEMPLATE = "Busy: a short answer for now."


def _go_red(server, clock: FakeClock, engine: FakeEngine) -> None:
    clock.advance(1.0)
    engine.timing.ttft = 1.0
    for r in burst(server, 6):
        assert r.status_code == 200, r.text
    assert server.state.slo.evaluate().to_dict()["tier"] == "red"
    engine.timing.ttft = 0.0


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)


def test_a_template_answer_is_marked_in_the_body_and_counts_no_completion_tokens(tmp_path):
    clock, engine = FakeClock(), FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    slo = slo_config(actions={"degrade": {"mode": "template", "template": TEMPLATE, "probe_every": 0}})
    with slo_server(tmp_path, clock, slo, engine) as server:
        _go_red(server, clock, engine)
        msgs = [{"role": "user", "content": "hello there"}]
        r = _client(server).chat.completions.create(model="fake", messages=msgs, max_tokens=50,
                                                    extra_headers={"X-Request-ID": "canned-1"})
        assert r.choices[0].message.content == TEMPLATE
        assert r.system_fingerprint == "tailguard-degraded:template"  # a typed field of the openai client
        assert r.model_extra["tailguard"]["degraded"]["mode"] == "template"
        assert r.usage.completion_tokens == 0  # the model produced nothing
        assert r.usage.total_tokens == r.usage.prompt_tokens > 0
        chunks = list(_client(server).chat.completions.create(
            model="fake", messages=msgs, max_tokens=50, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEMPLATE
        assert chunks[0].system_fingerprint == "tailguard-degraded:template"
        assert chunks[-1].usage.completion_tokens == 0
        assert chunks[-1].model_extra["tailguard"]["degraded"]["mode"] == "template"
        # The completions endpoint too.
        body = {"model": "fake", "prompt": "hello", "max_tokens": 5}
        c = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()
        assert c["system_fingerprint"] == "tailguard-degraded:template" and c["usage"]["completion_tokens"] == 0
        settle(server)
        rec = server.state.store.get("canned-1")
        assert rec["degraded"] is True and rec["output_tokens"] == 0


def test_a_truncated_answer_says_length_and_counts_what_was_produced(tmp_path):
    clock, engine = FakeClock(), FakeEngine(FakeTiming(ttft=0.01, itl=0.0))
    slo = slo_config(actions={"degrade": {"mode": "truncate", "max_tokens": 3, "probe_every": 0}})
    with slo_server(tmp_path, clock, slo, engine) as server:
        _go_red(server, clock, engine)
        msgs = [{"role": "user", "content": "hello there"}]
        r = _client(server).chat.completions.create(model="fake", messages=msgs, max_tokens=20)
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 3 == len(r.choices[0].message.content.encode())  # one byte a token
        assert r.system_fingerprint == "tailguard-degraded:truncate"
        deg = r.model_extra["tailguard"]["degraded"]
        assert deg["mode"] == "truncate" and deg["max_tokens"] == 3 and deg["requested_max_tokens"] == 20
        raw = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "fake", "messages": msgs, "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}})
        events = [json.loads(line[6:]) for line in raw.text.splitlines()
                  if line.startswith("data: {")]
        assert events[0]["system_fingerprint"] == "tailguard-degraded:truncate"
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 3
        assert events[-1]["tailguard"]["degraded"]["max_tokens"] == 3
        # A request that asked for fewer tokens than the cap gets what it asked for: nothing is invented.
        small = _client(server).chat.completions.create(model="fake", messages=msgs, max_tokens=2)
        assert small.usage.completion_tokens == 2
