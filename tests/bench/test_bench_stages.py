"""The stage join against a real tailguard server (fake engine): E2E split into the five server stages + network."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tailguard.bench.runner import execute
from tailguard.engine.fake import FakeTiming
from tests.bench_helpers import bench_config
from tests.serving_helpers import fake_server, settle

STAGES = {"tokenize", "queue", "prefill", "decode", "stream", "network_client"}


@pytest.mark.parametrize("join", ["auto", "fetch"])
def test_stage_join_splits_e2e_against_tailguard(tmp_path, join):
    # 2 engine slots for 6 concurrent streams: requests queue, so the queue stage is real and large
    timing = FakeTiming(ttft=0.02, itl=0.003, max_num_seqs=2)
    # Records are read with the client key that made the requests (the bench sends its --api-key).
    with fake_server(tmp_path, timing=timing, api_key="bench-key") as server:
        cfg = bench_config(server.url, concurrency=6, num_requests=24, output_tokens=8, join=join, api_key="bench-key")
        res, ms = asyncio.run(execute(cfg, display=False))
        settle(server)
    st = res["stages"]
    assert st["mode"] == "server" and st["sources"] == {"server": 24}
    assert st["stages"] == ["tokenize", "queue", "prefill", "decode", "stream", "network_client"]
    for m in ms:
        assert m.server_request_id == m.request_id  # joined by our X-Request-ID
        assert set(m.stages) == STAGES and min(m.stages.values()) >= 0
        assert sum(m.stages.values()) == pytest.approx(m.e2e, abs=2e-6)
        # the fake engine's scripted prefill (20 ms) and 7 decode gaps (3 ms each) are lower bounds
        assert m.stages["prefill"] >= 0.9 * 0.02 and m.stages["decode"] >= 0.9 * 7 * 0.003
    assert float(np.median([m.stages["prefill"] for m in ms])) == pytest.approx(0.02, abs=0.01)
    # with 3x more streams than slots, the mean request waits in the queue for about one request's service time
    assert st["mean_s"]["queue"] > 0.02
    assert "queue" in st["over_20_percent"]
    if join == "fetch":
        assert res["run"]["join"]["fetch"]["fetched"] == 24
        te = res["timing_error"]
        assert te["requests"] == 24 and te["ttft_client_minus_server_s"]["p50"] >= -0.001
    names = {r["slow_stage"] for r in res["slowest"]}
    assert names <= STAGES


def test_non_streamed_answers_are_split_from_the_server_timing_header(tmp_path):
    with fake_server(tmp_path, timing=FakeTiming(ttft=0.01, itl=0.002)) as server:
        cfg = bench_config(server.url, concurrency=2, num_requests=8, output_tokens=6, stream=False, join="auto")
        res, ms = asyncio.run(execute(cfg, display=False))
        settle(server)
    assert res["stages"]["mode"] == "server"
    for m in ms:
        assert m.chunks == 1 and m.output_tokens == 6 and m.itl == [] and m.tpot is None and m.ttft == m.e2e
        assert m.stages["decode"] >= 0.9 * 5 * 0.002  # the scripted gaps are a lower bound
        assert sum(m.stages.values()) == pytest.approx(m.e2e, abs=2e-6)
