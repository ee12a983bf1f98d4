"""64 concurrent streams all complete; the store then holds exactly one record each, stages summing to E2E."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tailguard.engine.fake import FakeTiming
from tests.serving_helpers import fake_server, settle

N = 64


def test_64_concurrent_streams_one_record_each(tmp_path):
    async def main(url: str) -> list[tuple[str, str, dict]]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=N)))
        async with client:
            async def one(i: int):
                lang = "你好，今天怎么样？" if i % 2 else "Hello, how are you today?"
                stream = await client.chat.completions.create(
                    model="fake", messages=[{"role": "user", "content": lang}], max_tokens=16 + i % 8, stream=True,
                    stream_options={"include_usage": True}, extra_headers={"X-Request-ID": f"c64-{i}"})
                parts, tg = [], None
                async for c in stream:
                    if c.choices and c.choices[0].delta.content:
                        parts.append(c.choices[0].delta.content)
                    if c.model_extra.get("tailguard"):
                        tg = c.model_extra["tailguard"]
                return f"c64-{i}", "".join(parts), tg

            return await asyncio.gather(*(one(i) for i in range(N)))

    timing = FakeTiming(ttft=0.01, itl=0.002, jitter=0.3, max_num_seqs=32)  # half of them queue in the engine
    with fake_server(tmp_path, timing) as s:
        results = asyncio.run(main(s.url))
        assert len(results) == N
        for rid, text, tg in results:
            i = int(rid.split("-")[1])
            assert len(text) == 16 + i % 8
            assert tg["request_id"] == rid
        settle(s)
        rows = s.state.store.query("SELECT request_id, outcome, e2e, tokenize, queue, prefill, decode, stream_time, "
                                   "output_tokens FROM requests")
        assert len(rows) == N
        assert sorted(r["request_id"] for r in rows) == sorted(f"c64-{i}" for i in range(N))
        for r in rows:
            assert r["outcome"] == "success"
            stages = r["tokenize"] + r["queue"] + r["prefill"] + r["decode"] + r["stream_time"]
            assert stages == pytest.approx(r["e2e"], abs=1e-3)
            assert min(r["tokenize"], r["queue"], r["prefill"], r["decode"], r["stream_time"]) >= 0
        # The engine had 32 slots: some of the 64 waited, and the queue stage shows it.
        assert max(r["queue"] for r in rows) > 0.01
        assert s.state.admission.depth == 0 and s.state.admission.in_flight == 0
