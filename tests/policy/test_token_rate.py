"""``capacity.tokens_per_s: auto``: the meter counts only saturated time (work waiting for the backend) and tokens
in the lanes' own unit (each request's estimate), closes a sample every window of saturated time, and the lanes
run on sequences alone until it has one; then their token budget is the measured rate x the horizon, split like
the sequences, and it binds."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from tailguard.policy.lanes import CapacityConfig, LaneConfig, Lanes
from tailguard.policy.token_rate import TokenRateMeter
from tests.policy.test_lanes_tokens import spin


def test_meter_counts_only_saturated_time_and_smooths_its_samples():
    m = TokenRateMeter(window_s=10.0, smoothing=0.5)
    # Idle or lightly loaded: tokens finish, but nothing waited for the backend. No estimate.
    assert not m.observe(0.0, saturated=False)
    assert not m.observe(30.0, saturated=True, finished_tokens=5000)  # finished in the idle stretch: not counted
    assert m.rate is None
    # Saturated from t=30: 8 s of it, 800 tokens finished; then 20 s unsaturated (not counted, nor its tokens).
    assert not m.observe(38.0, saturated=False, finished_tokens=800)
    assert not m.observe(58.0, saturated=True, finished_tokens=9999)
    # 2 more saturated seconds close the 10 s window: (800 + 200) / 10 s.
    assert m.observe(60.0, saturated=True, finished_tokens=200)
    assert m.rate == pytest.approx(100.0) and m.samples == 1
    # A second window at 300 tokens/s moves the estimate halfway (smoothing 0.5).
    assert m.observe(70.0, saturated=True, finished_tokens=3000)
    assert m.rate == pytest.approx(200.0) and m.samples == 2
    with pytest.raises(ValueError):
        TokenRateMeter(window_s=0)


def test_auto_config_is_validated_and_has_no_budget_until_measured():
    cfg = CapacityConfig(tokens_per_s="auto", token_horizon_s=5)
    assert cfg.token_budget is None and cfg.budget_for(100.0) == 500
    with pytest.raises(ValidationError):
        CapacityConfig(tokens_per_s="fast")
    with pytest.raises(ValidationError):
        CapacityConfig(tokens_per_s=-1)
    assert Lanes({"std": LaneConfig()}, 4).meter is None  # a configured (or no) rate measures nothing


def test_lanes_measure_the_rate_then_budget_tokens_with_it():
    async def main():
        now = [0.0]
        cfg = CapacityConfig(tokens_per_s="auto", token_horizon_s=2.0, drain_window_s=1.0, reserved_share=0,
                             burst_share=0)
        lanes = Lanes({"std": LaneConfig()}, 2, cfg)
        lanes.clock = lambda: now[0]
        std = lanes.lanes["std"]
        # No estimate yet: sequences alone decide, whatever the tokens.
        assert await lanes.acquire("std", "a", tokens=10_000) == 0.0
        assert await lanes.acquire("std", "a", tokens=10_000) == 0.0
        assert lanes.token_budget is None
        # A third waits for a sequence: the backend is saturated from here.
        waiter = asyncio.create_task(lanes.acquire("std", "a", tokens=100))
        await spin()
        assert std.waiting == 1 and lanes.saturated()
        # 0.5 s later one finishes (its estimate, 10,000, counts) and the waiter takes its slot: nobody waits any
        # more, so the next stretch is not counted.
        now[0] = 0.5
        lanes.release("std", 10_000)
        await spin()
        assert waiter.done() and not lanes.saturated() and lanes.token_budget is None
        # Queue again, 0.5 s of saturated time in which the first waiter (100) finishes: the window (1 s) closes at
        # (10,000 + 100) / 1 s, and the budget is that rate x 2 s.
        w2 = asyncio.create_task(lanes.acquire("std", "b", tokens=100))
        await spin()
        now[0] = 1.0
        lanes.release("std", 100)
        await spin()
        assert w2.done()
        assert lanes.meter.rate == pytest.approx(10_100.0) and lanes.token_budget == 20_200
        assert lanes.general_tokens == 20_200  # no reserve, no burst pool: all of it is general
        # Now the budget binds: 10,000 + 100 held; a 15,000-token request waits though sequences are free.
        lanes.set_capacity(10)
        big = asyncio.create_task(lanes.acquire("std", "c", tokens=15_000))
        await spin()
        assert not big.done() and std.tokens == 10_100
        now[0] = 1.1
        lanes.release("std", 10_000)
        await spin()
        assert big.done() and std.tokens == 15_100
        for cost in (100, 15_000):
            lanes.release("std", cost)
        assert std.tokens == 0 and std.in_use == 0
    asyncio.run(main())
