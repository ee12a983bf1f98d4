"""Stall fallback behind the gateway, with real replica processes: a stream that stalls at one replica (the fake
engine's scripted timings) carries on at a healthy one, as a continuation of the text already sent, in the same
stream; with no other replica, or when the lane says so, it ends with the template as before.

The two replicas write different texts (upper case at the stalled one, lower case at the healthy one), so the answer
shows exactly where it switched; the healthy replica's own record shows what it was asked (its prompt token count:
the fake engine's tokens are bytes)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tailguard.backends.upstream.events import continuation_body
from tailguard.engine.fake import ByteTokenizer
from tailguard.serving.chat_prompt import render_chat_prompt
from tests.serving.test_gateway import gateway, keyfile, metric_value, record, replica
from tests.serving_helpers import ADMIN, ADMIN_KEY, fake_server

SLOW = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # the stalling replica's text
FAST = "abcdefghijklmnopqrstuvwxyz"  # the healthy replica's text
MESSAGES = [{"role": "user", "content": "hello there"}]
# standard: stalls between tokens (the slow replica's first token comes in 1 s, within the TTFT deadline);
# batch: stalls before the first token; vip: the template, by configuration.
LANES = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0},
         "batch": {"priority": 2, "ttft_deadline_s": 0.1},
         "vip": {"priority": 0, "reserved": True, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0,
                 "stall_fallback": "template"}}


def _user_routed_to(gw: Any, name: str) -> str:
    """A ``user`` whose prefix-affinity route (the pool's own choice between idle replicas) is replica ``name``."""
    pool = gw.state.engine.pool
    for i in range(200):
        if pool.pick(pool.affinity_key(f"u{i}", "")).name == name:
            return f"u{i}"
    raise AssertionError("no user maps to that replica")


def _post(gw: Any, key: str, user: str, *, chat: bool = True, stream: bool = False, max_tokens: int = 12,
          prompt: str = "Once") -> httpx.Response:
    body: dict[str, Any] = {"model": "fake", "max_tokens": max_tokens, "stream": stream, "user": user}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _sse(r: httpx.Response) -> tuple[list[dict], str]:
    data = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert data[-1] == "[DONE]", r.text
    chunks = [json.loads(x) for x in data[:-1]]
    assert all("error" not in c for c in chunks), r.text
    text = ""
    for c in chunks:
        for ch in c["choices"]:
            text += ch.get("text") or ch.get("delta", {}).get("content") or ""
    return chunks, text


def _fallbacks_ok(gw: Any) -> float:
    """Stall fallbacks that completed (no sample yet: none)."""
    name = 'tailguard_stream_fallbacks_total{lane="standard",model="fake",outcome="ok"}'
    text = httpx.get(gw.url + "/metrics").text
    return metric_value(text, name) if name in text else 0.0


def _upstream_record(rep: Any, gateway_id: str) -> dict:
    """The replica's record of what the gateway sent it (the gateway's default upstream request id)."""
    rid = str(uuid.uuid5(uuid.NAMESPACE_URL, "tailguard:" + gateway_id))
    r = httpx.get(f"{rep.url}/v1/requests/{rid}", headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("fallback")
    path, keys = keyfile(tmp)
    # The replicas' records are read with the admin key (a replica started without one keeps them closed).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAILGUARD_ADMIN_KEY", ADMIN_KEY)
        with replica(tmp, "slow", ttft=1.0, itl=1.0, output_text=SLOW) as slow, \
                replica(tmp, "fast", ttft=0.01, itl=0.005, output_text=FAST) as fast, \
                gateway(tmp, [slow.url, fast.url], keys_file=str(path), lanes=LANES,
                        routing={"policy": "prefix", "breaker_failures": 100}) as gw:  # see the breaker test
            names = {r.url: r.name for r in gw.state.engine.pool.replicas}
            yield gw, keys, slow, fast, names[slow.url], names[fast.url], _user_routed_to(gw, names[slow.url])


def test_stream_stalled_between_tokens_continues_on_another_replica(cluster):
    gw, keys, _, fast, slow_name, fast_name, user = cluster
    before = _fallbacks_ok(gw)
    r = _post(gw, keys["std"], user, stream=True)
    assert r.status_code == 200
    chunks, text = _sse(r)
    # One answer: the stalled replica's first token, then the healthy one's continuation; max_tokens in total.
    assert text == SLOW[:1] + FAST[:11]
    assert {c["id"] for c in chunks} == {"chatcmpl-" + r.headers["x-request-id"]}
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1  # no second role chunk
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-1]["system_fingerprint"] == "tailguard-degraded:fallback"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    rec = record(gw, r)
    assert rec["degraded"] is True and rec["slo_action"]["mode"] == "fallback"
    assert rec["output_tokens"] == 12 and len(rec["token_times"]) == 12
    g = rec["gateway"]
    assert g["replica"] == fast_name
    assert g["fallback"] == {"from": slow_name, "after_tokens": 1, "outcome": "ok", "to": fast_name}
    assert g["itl_misses"] == 3
    # The healthy replica was asked to continue: the conversation with the assistant's partial answer left open.
    up = _upstream_record(fast, r.headers["x-request-id"])
    expected = render_chat_prompt(ByteTokenizer(), [*MESSAGES, {"role": "assistant", "content": SLOW[:1]}],
                                  add_generation_prompt=False, continue_final_message=True)
    assert expected.endswith("<|im_start|>assistant\n" + SLOW[:1])
    assert up["prompt_tokens"] == len(expected.encode()) and up["output_tokens"] == 11
    assert _fallbacks_ok(gw) == before + 1


def test_non_streaming_and_completions_fall_back_too(cluster):
    gw, keys, _, fast, _, fast_name, user = cluster
    r = _post(gw, keys["std"], user, max_tokens=6)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == SLOW[:1] + FAST[:5]
    assert body["usage"]["completion_tokens"] == 6
    assert body["system_fingerprint"] == "tailguard-degraded:fallback"
    assert r.headers["x-tailguard-degraded"].startswith("fallback;")
    assert record(gw, r)["gateway"]["fallback"]["to"] == fast_name

    c = _post(gw, keys["std"], user, chat=False, stream=True, max_tokens=6, prompt="Once")
    chunks, text = _sse(c)
    assert text == SLOW[:1] + FAST[:5] and chunks[-1]["usage"]["completion_tokens"] == 6
    # A completion's continuation is the prompt followed by the text already sent.
    assert _upstream_record(fast, c.headers["x-request-id"])["prompt_tokens"] == len("Once" + SLOW[:1])
    assert record(gw, c)["slo_action"]["mode"] == "fallback"


def test_stall_before_the_first_token_resends_the_request(cluster):
    gw, keys, _, fast, slow_name, fast_name, user = cluster
    r = _post(gw, keys["batch"], user, stream=True, max_tokens=8)
    chunks, text = _sse(r)
    assert text == FAST[:8]  # the whole answer from the healthy replica
    assert r.headers["x-tailguard-degraded"].startswith("fallback;")  # headers were not out yet
    assert chunks[0]["system_fingerprint"] == "tailguard-degraded:fallback"
    rec = record(gw, r)
    assert rec["gateway"]["fallback"] == {"from": slow_name, "after_tokens": 0, "outcome": "ok", "to": fast_name}
    assert rec["gateway"]["ttft_misses"] == 3 and rec["output_tokens"] == 8
    assert rec["ttft"] >= 0.3  # three 0.1 s deadlines were waited, then the healthy replica answered
    fresh = render_chat_prompt(ByteTokenizer(), MESSAGES)
    assert _upstream_record(fast, r.headers["x-request-id"])["prompt_tokens"] == len(fresh.encode())


def test_a_lane_can_keep_the_template(cluster):
    gw, keys, _, _, _, _, user = cluster
    r = _post(gw, keys["vip"], user, stream=True)
    _, text = _sse(r)
    assert text.startswith(SLOW[:1]) and "service is overloaded" in text
    rec = record(gw, r)
    assert rec["slo_action"]["mode"] == "stall" and "fallback" not in rec["gateway"]


def test_only_the_stalled_replica_left_ends_with_the_template(tmp_path: Path):
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0}}
    with replica(tmp_path, "slow", ttft=0.01, itl=1.0, output_text=SLOW) as slow, \
            gateway(tmp_path, [slow.url], lanes=lanes) as gw:
        for stream in (True, False):
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
                "model": "fake", "messages": MESSAGES, "max_tokens": 12, "stream": stream})
            assert r.status_code == 200
            text = _sse(r)[1] if stream else r.json()["choices"][0]["message"]["content"]
            assert text.startswith(SLOW[:1]) and "service is overloaded" in text
            rec = record(gw, r)
            assert rec["slo_action"]["mode"] == "stall"
            assert rec["gateway"]["fallback"] == {"from": gw.state.engine.pool.replicas[0].name, "after_tokens": 1,
                                                  "outcome": "no_replica"}
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, 'tailguard_stream_fallbacks_total{lane="standard",model="fake",'
                                     'outcome="no_replica"}') == 2.0
        assert metric_value(metrics, "tailguard_stream_degraded_requests_total") == 2.0


def test_a_tailguard_replica_continues_the_final_message(tmp_path: Path):
    tok = ByteTokenizer()
    convo = [*MESSAGES, {"role": "assistant", "content": "Hi th"}]
    text = render_chat_prompt(tok, convo, add_generation_prompt=False, continue_final_message=True)
    assert text == tok.render_chat(MESSAGES) + "Hi th"  # left open: no end of turn, no new assistant header
    # An empty final message is a fresh assistant turn.
    assert render_chat_prompt(tok, [*MESSAGES, {"role": "assistant", "content": ""}], False, True) == \
        tok.render_chat(MESSAGES)
    with fake_server(tmp_path, store_text=True) as server:
        ok = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "fake", "messages": convo, "max_tokens": 3, "continue_final_message": True,
            "add_generation_prompt": False, "user": "x"}, headers={"X-Request-ID": "cont-1"})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == len(text.encode())
        for bad, param in ((dict(continue_final_message=True), "continue_final_message"),
                           (dict(continue_final_message=True, add_generation_prompt=False, messages=MESSAGES),
                            "continue_final_message"),
                           (dict(add_generation_prompt="no"), "add_generation_prompt")):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"model": "fake", "messages": convo, "max_tokens": 3, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_fallback_stalls_too_and_the_template_ends_it(tmp_path: Path):
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0}}
    with replica(tmp_path, "s1", ttft=0.01, itl=1.0, output_text=SLOW) as s1, \
            replica(tmp_path, "s2", ttft=0.01, itl=1.0, output_text=FAST) as s2, \
            gateway(tmp_path, [s1.url, s2.url], lanes=lanes) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": MESSAGES, "max_tokens": 12, "stream": True})
        _, text = _sse(r)
        first, second = text[0], text[1]
        assert {first, second} == {SLOW[0], FAST[0]}  # one token from each, then the template
        assert "service is overloaded" in text[2:]
        rec = record(gw, r)
        assert rec["slo_action"]["mode"] == "stall" and rec["output_tokens"] == 2
        fb = rec["gateway"]["fallback"]
        assert fb["outcome"] == "stalled" and fb["after_tokens"] == 1 and fb["from"] != fb["to"]
        assert rec["gateway"]["itl_misses"] == 6


def test_continuation_matches_transformers_on_a_real_chat_template(tokenizer, hf_tokenizer):
    convo = [{"role": "user", "content": "Name three rivers."}, {"role": "assistant", "content": "The Nile, the "}]
    ours = render_chat_prompt(tokenizer, convo, add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\nThe Nile, the ")
    theirs = hf_tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
    assert ours == theirs


def test_a_replica_that_keeps_stalling_is_taken_out_by_its_breaker(tmp_path: Path):
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0}}
    with replica(tmp_path, "slow", ttft=0.01, itl=1.0, output_text=SLOW) as slow, \
            replica(tmp_path, "fast", ttft=0.01, itl=0.002, output_text=FAST) as fast, \
            gateway(tmp_path, [slow.url, fast.url], lanes=lanes,
                    # No health check meanwhile: one that passes closes the breaker again (the replica answers).
                    routing={"breaker_failures": 3, "breaker_cooldown_s": 60, "health_interval_s": 60}) as gw:
        slow_rep = next(r for r in gw.state.engine.pool.replicas if r.url == slow.url)
        fell_back = 0
        for _ in range(40):  # power-of-two choices between idle replicas: a coin toss each time
            r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
                "model": "fake", "messages": MESSAGES, "max_tokens": 6})
            assert r.json()["choices"][0]["message"]["content"] in (FAST[:6], SLOW[:1] + FAST[:5])
            fell_back += "fallback" in record(gw, r)["gateway"]
            if slow_rep.breaker.state == "open":
                break
        assert fell_back == 3 and slow_rep.breaker.state == "open"  # three stalls in a row open it
        assert slow_rep.last_error.startswith("a stream stalled")
        out = [httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": MESSAGES, "max_tokens": 6}) for _ in range(6)]
        assert all(r.json()["choices"][0]["message"]["content"] == FAST[:6] for r in out)  # no stall any more
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "tailguard_upstream_stalled_requests_total") == 3.0


def test_continuation_bodies():
    chat = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 10, "min_tokens": 4, "stream": False}
    out = continuation_body(chat, True, "Hel", 3, 10)
    assert out["messages"] == [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_tokens"] == 7 and "max_completion_tokens" not in out and out["min_tokens"] == 1
    assert chat["messages"] == MESSAGES and "max_tokens" not in chat  # the client's body is left as it was
    # A request that was a continuation already: its open message grows.
    again = continuation_body(out, True, "lo", 2, 7)
    assert again["messages"][-1] == {"role": "assistant", "content": "Hello"} and len(again["messages"]) == 2
    assert again["max_tokens"] == 5
    assert continuation_body({"prompt": ["Once"], "max_tokens": 5}, False, " upon", 2, 5) == \
        {"prompt": "Once upon", "max_tokens": 3}
    assert continuation_body({"prompt": [1, 2, 3]}, False, "x", 1, 5) is None  # token ids: not continuable
    assert continuation_body(chat, True, "", 0, 10) == chat  # before the first token: the request as it was


def test_a_fallback_that_fails_before_its_first_token_ends_with_the_template(tmp_path: Path):
    from tests.net import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lanes = {"standard": {"priority": 1, "itl_deadline_s": 0.1, "ttft_deadline_s": 5.0}}
    with replica(tmp_path, "slow", ttft=0.01, itl=1.0, output_text=SLOW) as slow, \
            gateway(tmp_path, [slow.url, dead], lanes=lanes,
                    routing={"policy": "prefix", "health_interval_s": 60, "retries": 0}) as gw:
        pool = gw.state.engine.pool
        names = {r.url: r.name for r in pool.replicas}
        next(r for r in pool.replicas if r.url == dead).healthy = True  # as if it had just died
        user = _user_routed_to(gw, names[slow.url])
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": "fake", "messages": MESSAGES, "max_tokens": 12, "stream": True, "user": user})
        _, text = _sse(r)
        assert text.startswith(SLOW[:1]) and "service is overloaded" in text
        rec = record(gw, r)
        assert rec["slo_action"]["mode"] == "stall"
        assert rec["gateway"]["fallback"] == {"from": names[slow.url], "after_tokens": 1, "outcome": "failed",
                                              "to": names[dead]}
