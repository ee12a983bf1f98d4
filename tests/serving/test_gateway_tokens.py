"""Capacity in tokens through the whole gateway, with a real fake-engine replica: each admitted request holds its
estimated cost (prompt + max_tokens) until it ends, batch waits once it holds its share of the token budget though
sequences are free, VIP is admitted at once on its reserve, a request larger than the whole budget is served alone,
the per-lane token gauges are in /metrics, and every token is given back."""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tailguard.policy.decision import TrafficPolicy
from tests.serving.test_gateway import chat, gateway, keyfile, metric_value, record, replica
from tests.serving_helpers import settle, wait_until

# The request path passes its estimate to the lanes (``TrafficPolicy.admit(decision, tl, tokens)``); without it every
# request counts in sequences only and there is nothing to test here.
WIRED = "tokens" in inspect.signature(TrafficPolicy.admit).parameters


def gauge(url: str, sample: str) -> float:
    """One sample's value in the gateway's /metrics (0 when absent)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.skipif(not WIRED, reason="the request path does not pass its token estimate to the lanes")
def test_token_budget_through_the_gateway(tmp_path):
    path, keys = keyfile(tmp_path)
    # 100 tokens of work: 20 reserved, 5 burst, 75 general. Sequences (40) never bind here.
    # The fake replica stands in for an engine that preempts: batch may borrow the idle reserve.
    capacity = {"tokens_per_s": 10, "token_horizon_s": 10, "upstream_queue_limit": None, "lend_reserve": True}
    with replica(tmp_path, "a", ttft=0.01, itl=0.02) as a, \
            gateway(tmp_path, [a.url], per_replica=40, keys_file=str(path), capacity=capacity) as gw:
        lanes = gw.state.lanes
        batch, vip = lanes.lanes["batch"], lanes.lanes["vip"]
        assert lanes.token_budget == 100
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(10) as pool:
            flood = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(10)]
            assert wait_until(lambda: batch.waiting > 0, timeout=10, interval=0.01)
            cost = batch.tokens // batch.in_use
            assert cost > 20 and batch.tokens == cost * batch.in_use  # prompt estimate + max_tokens each
            # Batch stops at its share (general + the idle reserve) though 40 sequences are free.
            assert batch.tokens <= 95 < batch.tokens + cost and batch.in_use < 10
            # The gauges (sampled every 250 ms): tokens held by batch, and the budget's split.
            assert wait_until(lambda: gauge(gw.url, 'tailguard_lane_in_use_tokens{lane="batch",model="fake"}')
                              >= cost, timeout=5)
            assert gauge(gw.url, 'tailguard_lane_capacity_tokens{model="fake",part="reserved"}') == 20
            assert metric_value(httpx.get(gw.url + "/metrics").text, "tailguard_lane_capacity_tokens") == 200
            vip_r = chat(gw.url, keys["vip"], 2, False, c)
            results = [f.result() for f in flood]
        assert vip_r.status_code == 200 and record(gw, vip_r)["gateway"]["lane_wait"] < 0.05
        assert [r.status_code for r in results] == [200] * 10
        assert max(record(gw, r)["gateway"]["lane_wait"] for r in results) > 0.1  # some waited for tokens
        settle(gw)
        assert all(s.tokens == 0 and s.in_use == 0 for s in lanes.lanes.values())
        # A request larger than the whole budget is served alone, not refused and not stuck.
        big = chat(gw.url, keys["batch"], 150)
        assert big.status_code == 200 and record(gw, big)["output_tokens"] == 150
        settle(gw)
        assert batch.tokens == 0 and vip.tokens == 0


@pytest.mark.skipif(not WIRED, reason="the request path does not pass its token estimate to the lanes")
def test_auto_token_rate_is_measured_while_batch_queues(tmp_path):
    """``tokens_per_s: auto``: no budget until work waits; a batch flood through a 4-sequence gateway then gives a
    measured rate close to what the replica drained (estimated tokens per second over the flood), and the budget is
    that rate x the horizon, in /metrics too."""
    path, keys = keyfile(tmp_path)
    capacity = {"tokens_per_s": "auto", "token_horizon_s": 4, "drain_window_s": 0.5, "upstream_queue_limit": None}
    with replica(tmp_path, "a", ttft=0.01, itl=0.02) as a, \
            gateway(tmp_path, [a.url], per_replica=4, keys_file=str(path), capacity=capacity) as gw:
        lanes = gw.state.lanes
        assert lanes.meter is not None and lanes.token_budget is None
        assert chat(gw.url, keys["batch"], 4).status_code == 200  # alone: nothing waited, nothing measured
        settle(gw)
        assert lanes.meter.rate is None and lanes.token_budget is None
        with httpx.Client(timeout=60) as c, ThreadPoolExecutor(24) as pool:
            flood = [pool.submit(chat, gw.url, keys["batch"], 20, False, c) for _ in range(24)]
            results = [f.result() for f in flood]
        assert [r.status_code for r in results] == [200] * 24
        settle(gw)
        recs = [record(gw, r) for r in results]
        # What each request held while admitted: the gateway's estimate (prompt + max_tokens), in the record.
        held = [r["gateway"]["lane_tokens"] for r in recs]
        assert all(h > 20 for h in held)
        t0 = [r["timestamps"]["received_monotonic"] for r in recs]
        span = max(t + r["timestamps"]["last_byte"] for t, r in zip(t0, recs)) - min(t0)
        drained = sum(held) / span
        rate = lanes.meter.rate
        assert rate is not None and lanes.meter.samples >= 1
        assert 0.5 * drained < rate < 2.0 * drained, (rate, drained)
        assert lanes.token_budget == int(rate * 4)
        assert wait_until(lambda: metric_value(httpx.get(gw.url + "/metrics").text, "tailguard_lane_token_rate") > 0,
                          timeout=5)
        assert all(s.tokens == 0 and s.in_use == 0 for s in lanes.lanes.values())
