"""The official ``openai`` client, sync and async, streaming and not, Chinese and English, against the fake engine."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tailguard.engine.fake import FakeTiming
from tailguard.observe.timeline import STAGES
from tests.serving_helpers import ADMIN, fake_server, settle

PROMPTS = {"en": "Hello! Please introduce yourself in one sentence.", "zh": "你好！请用一句话介绍一下你自己。"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with fake_server(tmp_path_factory.mktemp("openai"), FakeTiming(ttft=0.005, itl=0.001)) as s:
        yield s


@pytest.fixture(scope="module")
def zh_server(tmp_path_factory):
    # The fake engine's output is UTF-8 bytes as tokens: Chinese output spans several tokens per character.
    timing = FakeTiming(ttft=0.005, itl=0.001, output_text="你好，世界！这是一个测试。")
    with fake_server(tmp_path_factory.mktemp("zh"), timing) as s:
        yield s


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_chat_sync_non_streaming(server, lang):
    raw = _client(server).chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": PROMPTS[lang]}], max_tokens=12,
        extra_headers={"X-Request-ID": f"sync-{lang}", "X-Business-Type": "finance"}, user="alice",
    )
    resp = raw.parse()
    assert raw.headers["x-request-id"] == f"sync-{lang}"
    assert resp.choices[0].message.content == "The quick br"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > len(PROMPTS[lang])
    timing = dict(p.split(";dur=") for p in raw.headers["server-timing"].split(", "))
    assert set(STAGES) <= set(timing)
    tg = resp.model_extra["tailguard"]
    assert tg["request_id"] == f"sync-{lang}" and set(tg["stages"]) == set(STAGES)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_chat_sync_streaming(server, lang):
    stream = _client(server).chat.completions.create(
        model="fake", messages=[{"role": "user", "content": PROMPTS[lang]}], max_tokens=10, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The quick "
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    tg = last.model_extra["tailguard"]
    assert set(tg["stages"]) == set(STAGES) and tg["ttft"] > 0
    assert sum(tg["stages"].values()) == pytest.approx(tg["e2e"], abs=1e-5)


def test_chat_async_streaming_and_not_zh_en(server):
    async def main():
        client = _async_client(server)
        async with client:
            async def one(lang: str, stream: bool) -> str:
                msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[lang]}]
                if not stream:
                    r = await client.chat.completions.create(model="fake", messages=msgs, max_tokens=9, seed=7)
                    return r.choices[0].message.content
                parts = []
                async for c in await client.chat.completions.create(model="fake", messages=msgs, max_tokens=9,
                                                                    stream=True, temperature=0.0):
                    if c.choices and c.choices[0].delta.content:
                        parts.append(c.choices[0].delta.content)
                return "".join(parts)

            return await asyncio.gather(*(one(lang, s) for lang in PROMPTS for s in (False, True)))

    assert asyncio.run(main()) == ["The quick"] * 4


def test_chinese_output_stream_and_non_stream(zh_server):
    client = _client(zh_server)
    msgs = [{"role": "user", "content": PROMPTS["zh"]}]
    full = client.chat.completions.create(model="fake", messages=msgs, max_tokens=15)
    assert full.choices[0].message.content == "你好，世界"  # 15 bytes = 5 characters of 3 bytes
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="fake", messages=msgs, max_tokens=15, stream=True) if c.choices)
    assert streamed == full.choices[0].message.content


def test_completions_sync_and_async(server):
    client = _client(server)
    r = client.completions.create(model="fake", prompt="Once upon a time", max_tokens=5, logprobs=2)
    assert r.choices[0].text == "The q" and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == ["T", "h", "e", " ", "q"]
    assert r.usage.prompt_tokens == len(b"Once upon a time")
    r2 = client.completions.create(model="fake", prompt=[[ord("h") + 3, ord("i") + 3]], max_tokens=3)
    assert r2.usage.prompt_tokens == 2
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="fake", prompt="从前有座山", max_tokens=6, stream=True, stop=["zz"]) if c.choices)
    assert text == "The qu"

    async def main():
        async with _async_client(server) as ac:
            r = await ac.completions.create(model="fake", prompt="hello", max_tokens=4)
            parts = [c.choices[0].text async for c in await ac.completions.create(
                model="fake", prompt="hello", max_tokens=4, stream=True) if c.choices]
            return r.choices[0].text, "".join(parts)

    assert asyncio.run(main()) == ("The ", "The ")


def test_stop_sequence(server):
    r = _client(server).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=30, stop=["brown"])
    assert r.choices[0].message.content == "The quick " and r.choices[0].finish_reason == "stop"


def test_chat_logprobs_shape(server):
    r = _client(server).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["T", "h", "e"]
    assert content[0].bytes == [ord("T")]


def test_models_health_ready(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["fake"]
    assert client.models.retrieve("fake").id == "fake"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"


def test_record_by_id_has_token_timestamps(server):
    client = _client(server)
    list(client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "你好"}], max_tokens=6,
                                        stream=True, extra_headers={"X-Request-ID": "rec-1", "X-User-ID": "u-42"}))
    settle(server)
    rec = httpx.get(server.url + "/v1/requests/rec-1", headers=ADMIN).json()
    assert rec["request_id"] == "rec-1" and rec["outcome"] == "success" and rec["stream"] is True
    assert rec["user"] == server.state.store.pseudonym("u-42") and rec["business_type"] == "default"
    assert len(rec["token_times"]) == len(rec["token_sent"]) == rec["output_tokens"] == 6
    assert rec["token_sent"] == sorted(rec["token_sent"])
    assert all(s >= t for s, t in zip(rec["token_sent"], rec["token_times"]))
    assert sum(rec["stages"].values()) == pytest.approx(rec["e2e"], abs=1e-3)
    ts = rec["timestamps"]
    assert 0 <= ts["tokenized"] <= ts["scheduled"] <= ts["first_token"] <= ts["last_token"] <= ts["last_byte"]
    assert rec["resources"]["in_flight"] >= 1
    missing = httpx.get(server.url + "/v1/requests/nope", headers=ADMIN)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_reused_request_id_returns_the_latest_record(server):
    client = _client(server)
    for n in (3, 5):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=n,
                                       extra_headers={"X-Request-ID": "reused-1"})
        # At once (maybe before the store has it) and after the store has caught up: always this request's record.
        assert httpx.get(server.url + "/v1/requests/reused-1", headers=ADMIN).json()["output_tokens"] == n
        settle(server)
        assert httpx.get(server.url + "/v1/requests/reused-1", headers=ADMIN).json()["output_tokens"] == n


def test_metrics_endpoint_parses(server):
    from prometheus_client.parser import text_string_to_metric_families

    _client(server).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"tailguard_time_to_first_token_seconds", "tailguard_e2e_request_latency_seconds",
            "tailguard_num_requests_running", "tailguard_kv_cache_blocks_used", "tailguard_requests"} <= names
