"""Capacity in tokens and the upstream queue gate, on the real ``Lanes`` class under asyncio: a request must fit the
token budget as well as the sequences, holds its cost until released (exactly), VIP keeps its token reserve while
batch fills the rest, a request larger than the whole budget is admitted alone (never deadlocks, never refused), and
while the upstream replicas queue too much only the reserved lane is admitted. Also the upstream pool's queue
estimate between two reads of a replica's /metrics, and a fleet (real Redis): slots are the fleet's, the token
budget this gateway's."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from tailguard.backends.upstream.pool import UpstreamConfig, UpstreamPool
from tailguard.policy.fleet_state import RedisState
from tailguard.policy.lanes import CapacityConfig, LaneConfig, Lanes, default_lanes


def run(coro):
    return asyncio.run(coro)


async def spin() -> None:
    """Let woken waiters run (an admission resolves a future; its task needs a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


def tokens_cfg(**kw) -> CapacityConfig:
    return CapacityConfig(**{"tokens_per_s": 100.0, "token_horizon_s": 10.0, **kw})  # a 1000-token budget


def test_token_budget_split_follows_the_sequences_split():
    lanes = Lanes(default_lanes(), 20, tokens_cfg())
    assert lanes.token_budget == 1000
    assert (lanes.reserved_tokens, lanes.burst_tokens, lanes.general_tokens) == (200, 50, 750)
    off = Lanes(default_lanes(), 20)
    assert off.token_budget is None and off.snapshot()["batch"]["tokens"] == 0
    with pytest.raises(ValidationError):
        CapacityConfig(tokens_per_s=0)
    with pytest.raises(ValidationError):
        CapacityConfig(tokens_per_s=10, token_horizon_s=-1)


def test_token_budget_queues_and_releases_exactly():
    async def main():
        lanes = Lanes({"std": LaneConfig()}, 100, tokens_cfg(reserved_share=0, burst_share=0))
        std = lanes.lanes["std"]
        assert await lanes.acquire("std", "a", tokens=600) == 0.0
        assert await lanes.acquire("std", "a", tokens=300) == 0.0
        assert std.tokens == 900 and std.in_use == 2  # plenty of sequences left: tokens are what binds
        # A request that passes no tokens is counted in sequences only (today's callers).
        assert await lanes.acquire("std", "c") == 0.0 and std.in_use == 3 and std.tokens == 900
        big = asyncio.create_task(lanes.acquire("std", "a", tokens=200))
        small = asyncio.create_task(lanes.acquire("std", "b", tokens=50))
        await spin()
        # 900 + 200 > 1000: the head waits, and the 50-token request behind it does not overtake it.
        assert not big.done() and not small.done() and std.waiting == 2
        lanes.release("std", 300)
        await spin()
        assert big.done() and small.done() and std.tokens == 600 + 200 + 50
        for cost in (600, 200, 50, 0):
            lanes.release("std", cost)
        assert std.tokens == 0 and std.waiting == 0 and std.in_use == 0
    run(main())


def test_vip_admitted_on_its_token_reserve_while_batch_holds_the_rest():
    async def main():
        lanes = Lanes(default_lanes(), 100, tokens_cfg())  # tokens: 200 reserved, 50 burst, 750 general
        batch, vip = lanes.lanes["batch"], lanes.lanes["vip"]
        # Batch alone borrows the idle reserve (never the burst pool): 750 + 200.
        for _ in range(19):
            assert await lanes.acquire("batch", "crawler", tokens=50) == 0.0
        waiter = asyncio.create_task(lanes.acquire("batch", "crawler", tokens=50))
        await spin()
        assert batch.tokens == 950 and not waiter.done()
        # VIP is admitted at once on its reserve (batch's borrowed tokens count only up to general + burst).
        assert await asyncio.wait_for(lanes.acquire("vip", "acme", tokens=150), 0.1) == 0.0
        assert await asyncio.wait_for(lanes.acquire("vip", "acme", tokens=50), 0.1) == 0.0
        assert vip.tokens == 200 and lanes.snapshot()["vip"]["tokens"] == 200
        # A freed batch slot is borrowed reserve: while VIP is busy it goes back to VIP, not to batch.
        for _ in range(4):
            lanes.release("batch", 50)
        await spin()
        assert not waiter.done() and batch.tokens == 750
        lanes.release("batch", 50)
        await spin()
        assert waiter.done() and batch.tokens == 750  # back under the general share: the waiter is in
        # A standard request may use the burst pool when the general part is full; batch may not.
        assert await asyncio.wait_for(lanes.acquire("standard", "shop", tokens=50), 0.1) == 0.0
        late = asyncio.create_task(lanes.acquire("batch", "crawler", tokens=10))
        await spin()
        assert not late.done()
        late.cancel()
        await spin()
        lanes.release("standard", 50)
        lanes.release("vip", 150)
        lanes.release("vip", 50)
        for _ in range(15):
            lanes.release("batch", 50)
        assert all(s.tokens == 0 and s.in_use == 0 and s.waiting == 0 for s in lanes.lanes.values())
    run(main())


def test_a_request_larger_than_the_budget_is_admitted_alone():
    async def main():
        lanes = Lanes(default_lanes(), 100, tokens_cfg())
        batch, std = lanes.lanes["batch"], lanes.lanes["standard"]
        assert await lanes.acquire("standard", "shop", tokens=100) == 0.0
        huge = asyncio.create_task(lanes.acquire("batch", "crawler", tokens=5000))
        await spin()
        assert not huge.done()  # something else outside the reserve holds tokens: it waits
        lanes.release("standard", 100)
        await spin()
        assert huge.done() and batch.tokens == 5000  # alone: it holds its full cost
        # While it runs the rest of the non-reserved lanes wait; VIP is still admitted on its reserve.
        other = asyncio.create_task(lanes.acquire("standard", "shop", tokens=10))
        await spin()
        assert not other.done()
        assert await asyncio.wait_for(lanes.acquire("vip", "acme", tokens=100), 0.1) == 0.0
        # A VIP request larger than the whole budget is admitted when no VIP request holds tokens.
        vip_huge = asyncio.create_task(lanes.acquire("vip", "acme", tokens=4000))
        await spin()
        assert not vip_huge.done()
        lanes.release("vip", 100)
        await spin()
        assert vip_huge.done()
        lanes.release("vip", 4000)
        lanes.release("batch", 5000)
        await spin()
        assert other.done() and std.tokens == 10
        lanes.release("standard", 10)
        assert all(s.tokens == 0 and s.in_use == 0 for s in lanes.lanes.values())
    run(main())


def test_a_cancelled_token_waiter_gives_nothing_back_it_did_not_hold():
    async def main():
        lanes = Lanes({"std": LaneConfig()}, 100, tokens_cfg(reserved_share=0, burst_share=0))
        std = lanes.lanes["std"]
        await lanes.acquire("std", "a", tokens=1000)
        gone = asyncio.create_task(lanes.acquire("std", "b", tokens=400))
        after = asyncio.create_task(lanes.acquire("std", "c", tokens=300))
        await spin()
        gone.cancel()
        await spin()
        assert std.waiting == 1 and std.tokens == 1000
        lanes.release("std", 1000)
        await spin()
        assert after.done() and std.tokens == 300 and std.in_use == 1
    run(main())


def test_upstream_queue_gate_keeps_batch_at_the_gateway_and_lets_vip_in_up_to_its_reserve():
    async def main():
        full = [False]
        lanes = Lanes(default_lanes(), 20, upstream_full=lambda admitted: full[0])  # reserve: 4 sequences
        batch, vip = lanes.lanes["batch"], lanes.lanes["vip"]
        assert await lanes.acquire("batch", "crawler") == 0.0
        full[0] = True
        queued = [asyncio.create_task(lanes.acquire("batch", "crawler")) for _ in range(3)]
        std = asyncio.create_task(lanes.acquire("standard", "shop"))
        await spin()
        # Plenty of sequences, but the upstreams queue: batch and standard wait here, not upstream.
        assert batch.in_use == 1 and batch.waiting == 3 and not std.done()
        for _ in range(4):
            assert await asyncio.wait_for(lanes.acquire("vip", "acme"), 0.1) == 0.0
        fifth = asyncio.create_task(lanes.acquire("vip", "acme"))
        await spin()
        assert vip.in_use == 4 and not fifth.done()  # VIP is admitted up to its reserve, no further
        # A release alone does not open the gate while the upstream still queues.
        lanes.release("batch")
        await spin()
        assert batch.waiting == 3
        # The queue drains (a new read): poke admits the waiters, VIP first.
        full[0] = False
        lanes.poke()
        await spin()
        assert fifth.done() and std.done() and all(t.done() for t in queued)
        assert vip.in_use == 5 and batch.in_use == 3
    run(main())


def test_replica_queue_estimate_follows_the_gateways_own_traffic_between_reads():
    pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9"), UpstreamConfig(url="http://127.0.0.1:10")])
    a, b = pool.replicas
    assert not pool.queue_full(0)  # nobody reports a queue: the gate stays open
    # As _scrape leaves them: a reports 3 waiting with 8 of ours in flight; b reports an empty queue.
    for r, waiting in ((a, 3.0), (b, 0.0)):
        r.reports_queue, r.upstream_waiting, r.in_flight, r.in_flight_at_scrape = True, waiting, 8, 8
    assert a.queue_estimate() == 3 and b.queue_estimate() == 0
    assert pool.queue_full(1) and not pool.queue_full(2)  # 3 waiting over 2 replicas: > 1 each, <= 2 each
    a.in_flight = 6  # two of ours finished there: two waiting ones got in
    assert a.queue_estimate() == 1 and not pool.queue_full(1)
    a.in_flight = 12  # four more sent while it is full: they queue
    assert a.queue_estimate() == 7 and pool.queue_full(2)
    a.in_flight = 0
    assert a.queue_estimate() == 0
    b.in_flight = 20  # a replica that read an empty queue is not assumed full
    assert b.queue_estimate() == 0
    a.in_flight, a.healthy = 12, False  # an unhealthy replica does not count
    assert not pool.queue_full(0)


def test_a_replica_that_showed_its_slots_queues_a_burst_sent_between_two_reads():
    pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9")])
    (r,) = pool.replicas
    # A read while it queued: 4 running, 2 waiting, 6 of ours in flight. It runs 4 at once.
    r.reports_queue, r.upstream_waiting, r.upstream_running, r.in_flight, r.in_flight_at_scrape = True, 2, 4, 6, 6
    r.slots = 4
    assert r.queue_estimate() == 2
    # A later read: no queue, 1 running (ours). A burst of 10 sent before the next read: 3 fit, 7 wait.
    r.upstream_waiting, r.upstream_running, r.in_flight, r.in_flight_at_scrape = 0, 1, 1, 1
    assert r.queue_estimate() == 0
    r.in_flight = 11
    assert r.queue_estimate() == 7 and pool.queue_full(2)
    r.in_flight = 3  # all but 3 done: it runs 3 of its 4 slots, no queue
    assert r.queue_estimate() == 0 and not pool.queue_full(0)
    # A burst the gateway admitted in one moment, not yet sent: beyond the free slot it will queue.
    assert r.free_slots() == 1
    assert not pool.queue_full(1, admitted=3 + 2) and pool.queue_full(1, admitted=3 + 3)
    # Without a running gauge (or before it ever queued) nothing is assumed about its slots.
    r.upstream_running = None
    assert r.free_slots() is None and not pool.queue_full(1, admitted=100)
    r.in_flight = 50
    assert r.queue_estimate() == 0


def test_the_gate_is_asked_with_what_the_gateway_has_admitted():
    async def main():
        asked: list[int] = []

        def full(admitted: int) -> bool:
            asked.append(admitted)
            return admitted >= 3

        lanes = Lanes(default_lanes(), 20, upstream_full=full)
        for _ in range(3):
            assert await lanes.acquire("standard", "shop") == 0.0
        held = asyncio.create_task(lanes.acquire("batch", "crawler"))
        await spin()
        assert not held.done() and lanes.gate_closed() and asked[-1] == 3
        lanes.release("standard")
        await spin()
        assert held.done() and lanes.lanes["batch"].in_use == 1
    run(main())



def test_in_a_fleet_the_slots_are_the_fleets_and_the_token_budget_is_this_gateways(redis):
    lanes_cfg = {"standard": LaneConfig()}
    cfg = tokens_cfg(reserved_share=0, burst_share=0)  # 1000 tokens per gateway

    async def main() -> None:
        sa, sb = RedisState(redis.url, gateway_id="a"), RedisState(redis.url, gateway_id="b")
        a, b = Lanes(lanes_cfg, 4, cfg, fleet=sa), Lanes(lanes_cfg, 4, cfg, fleet=sb)  # 4 slots for the fleet
        std_a, std_b = a.lanes["standard"], b.lanes["standard"]
        assert await a.acquire("standard", "x", tokens=800) == 0.0
        # This gateway's token budget holds the next one back though the fleet has slots...
        held = asyncio.create_task(a.acquire("standard", "x", tokens=300))
        await asyncio.sleep(0.1)
        assert not held.done() and std_a.waiting == 1
        assert await sa.fleet_in_use(["standard"]) == {"standard": 1}  # ...and it took no fleet slot meanwhile
        # The other gateway has its own token budget, but shares the fleet's slots: it fills them.
        for cost in (900, 50, 40):
            assert await b.acquire("standard", "y", tokens=cost) == 0.0
        a.release("standard", 800)
        await asyncio.wait_for(held, 5)  # tokens and a fleet slot are back here: the pump admits it
        assert std_a.tokens == 300 and await sa.fleet_in_use(["standard"]) == {"standard": 4}
        # Now the fleet's slots bind, though this gateway has tokens to spare.
        small = asyncio.create_task(a.acquire("standard", "x", tokens=10))
        await asyncio.sleep(0.1)
        assert not small.done()
        b.release("standard", 50)
        await asyncio.wait_for(small, 5)
        assert std_a.tokens == 310 and std_b.tokens == 940
        for lanes, cost in ((a, 300), (a, 10), (b, 900), (b, 40)):
            lanes.release("standard", cost)
        await asyncio.sleep(0.1)
        assert await sa.fleet_in_use(["standard"]) == {"standard": 0}
        assert std_a.tokens == 0 and std_b.tokens == 0
        await sa.close()
        await sb.close()

    run(main())
