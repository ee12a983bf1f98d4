"""A lane's TTFT target: a request whose first token is predicted past it is refused at once (429 + Retry-After),
not served late; the prediction is the backend's (here the scripted engine's, played forward)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.sequence import SamplingParams
from tests.serving_helpers import ADMIN, fake_server, settle, wait_until


def test_the_scripted_engine_predicts_its_own_queue():
    async def main() -> None:
        eng = FakeEngine(FakeTiming(ttft=0.05, itl=0.05, max_num_seqs=1, priority_scheduling=True))
        assert eng.predict_ttft(10) == pytest.approx(0.05, abs=0.01)  # a free slot: its prefill alone

        async def run(rid: str, max_tokens: int, priority: int = 0) -> None:
            async for _ in eng.generate([65] * 10, SamplingParams(max_tokens=max_tokens), rid, priority=priority):
                pass

        long = asyncio.create_task(run("long", 40))  # 0.05 + 39 x 0.05 = 2.0 s in the only slot
        await asyncio.sleep(0.2)
        assert eng.predict_ttft(10) == pytest.approx(2.0 - 0.2 + 0.05, abs=0.1)
        queued = asyncio.create_task(run("queued", 20, priority=1))  # 1.0 s more once the slot frees
        await asyncio.sleep(0.05)
        assert eng.predict_ttft(10, priority=1) == pytest.approx(2.0 - 0.25 + 1.0 + 0.05, abs=0.1)
        # A more important request goes before the queued one.
        assert eng.predict_ttft(10, priority=0) == pytest.approx(2.0 - 0.25 + 0.05, abs=0.1)
        eng.abort("long")
        eng.abort("queued")
        await asyncio.gather(long, queued)

    asyncio.run(main())


def _chat(url: str, max_tokens: int, lane: str = "standard") -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"X-Lane": lane}, timeout=30, json={
        "model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens})


def _record(url: str, response: httpx.Response) -> dict:
    rid = response.headers["x-request-id"]
    return httpx.get(f"{url}/v1/requests/{rid}", headers=ADMIN).json()


@pytest.mark.parametrize("lane_capacity", [8, 1])
def test_a_request_predicted_past_its_lanes_ttft_target_is_refused_at_once(tmp_path, lane_capacity):
    """The engine has one slot. The lanes admit 8 (the rest waits in the engine's queue) or 1 (it waits in the lane's
    queue): either way a request that would wait ~2 s for its first token is refused at once."""
    lanes = {"standard": {"priority": 1, "ttft_target_s": 0.5}, "batch": {"priority": 2}}
    timing = FakeTiming(ttft=0.05, itl=0.05, max_num_seqs=1)
    with fake_server(tmp_path, timing, lanes=lanes, capacity={"max_concurrent": lane_capacity, "reserved_share": 0},
                     trust_lane_header=True) as s, ThreadPoolExecutor(2) as pool:
        engine = s.state.engine.engine
        first = _chat(s.url, 2)
        assert first.status_code == 200
        assert _record(s.url, first)["gateway"]["predicted_ttft"] < 0.2  # an idle engine: its prefill
        long = pool.submit(_chat, s.url, 40)  # holds the only slot for ~2 s
        assert wait_until(lambda: engine.running == 1, timeout=5)
        t0 = time.perf_counter()
        late = _chat(s.url, 2)
        answered_in = time.perf_counter() - t0
        assert late.status_code == 429 and answered_in < 0.5  # at once, not after the wait it would have had
        err = late.json()["error"]
        assert err["code"] == "ttft_target_unreachable" and "0.5 s" in err["message"]
        assert int(late.headers["retry-after"]) >= 1
        rec = _record(s.url, late)
        assert rec["outcome"] == "rejected" and 1.2 < rec["gateway"]["predicted_ttft"] < 2.5
        # A lane without a target waits its turn and is served.
        patient = pool.submit(_chat, s.url, 2, "batch")
        assert long.result().status_code == 200 and patient.result().status_code == 200
        settle(s)
        assert 'tailguard_lane_ttft_refused_requests_total{lane="standard"' in httpx.get(s.url + "/metrics").text
        assert _chat(s.url, 2).status_code == 200  # the slot is free again: predicted inside the target


@pytest.mark.parametrize(("margin", "predicted", "refused"),
                         [(1.3, 1.2, False), (1.3, 1.4, True), (1.0, 1.05, True), (1.0, 0.95, False)])
def test_the_margin_says_how_sure_a_refusal_must_be(margin, predicted, refused):
    """Target 1 s: with the default margin (1.3) a request predicted at 1.2 s is served and one at 1.4 s refused;
    with 1.0 whatever is predicted past the target is refused. The wait so far counts whole."""
    from tailguard.api_error import APIError
    from tailguard.observe.timeline import Timeline
    from tailguard.policy.decision import Decision, TrafficPolicy
    from tailguard.policy.fleet_state import LocalState
    from tailguard.policy.lanes import LaneConfig

    policy = TrafficPolicy(None, LocalState(), None, None, default_lane="standard", trust_lane_header=False)
    d = Decision(lane=LaneConfig(ttft_target_s=1.0, ttft_target_margin=margin))
    tl = Timeline("r1", "/v1/chat/completions")
    now = tl.received + 0.2  # it has waited 0.2 s: the prediction from here is 0.2 s less
    if refused:
        with pytest.raises(APIError) as err:
            policy.refuse_late(d, tl, predicted - 0.2, now)
        assert err.value.status == 429 and err.value.code == "ttft_target_unreachable"
    else:
        policy.refuse_late(d, tl, predicted - 0.2, now)
    assert tl.gateway["predicted_ttft"] == pytest.approx(predicted)
