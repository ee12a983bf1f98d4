"""The gateway's parts on their own: lanes and reserved capacity, tenants and rate limits, breakers, routing and the
stall watch. Deterministic: no servers, injected clocks where time matters."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from tailguard.backends.stall_watch import KEEPALIVE, Stalled, watch
from tailguard.backends.upstream.pool import (
    CircuitBreaker,
    RoutingConfig,
    UpstreamConfig,
    UpstreamPool,
    queue_gauges,
)
from tailguard.backends.upstream.sse import SSELines, SSELineTooLong, TokenTexts, read_chunk, token_text
from tailguard.policy.lanes import CapacityConfig, LaneConfig, Lanes, Overloaded, default_lanes
from tailguard.policy.tenants import (
    KeyFile,
    RateLimited,
    Tenant,
    TenantConfig,
    Tenants,
    TokenBucket,
    hash_key,
)


def run(coro):
    return asyncio.run(coro)


async def spin() -> None:
    """Let woken waiters run (an admission resolves a future; its task needs a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


# --- lanes --------------------------------------------------------------------------------------------------------
def test_capacity_split_and_vip_admitted_while_batch_saturates():
    async def main():
        lanes = Lanes(default_lanes(), 20)
        assert (lanes.reserved, lanes.burst, lanes.general) == (4, 1, 15)
        # Batch alone may borrow the idle reserve but never the burst pool: 15 general + 4 reserved.
        for _ in range(19):
            await lanes.acquire("batch", "crawler")
        waiter = asyncio.create_task(lanes.acquire("batch", "crawler"))
        await asyncio.sleep(0)
        assert not waiter.done() and lanes.lanes["batch"].waiting == 1
        # A VIP arrival is admitted at once, even though batch borrowed its reserve (the engine preempts by
        # priority); while VIP is busy, batch gets nothing back.
        for _ in range(4):
            assert await asyncio.wait_for(lanes.acquire("vip", "acme"), 0.1) == 0.0
        assert lanes.lanes["vip"].in_use == 4
        lanes.release("batch")
        await spin()
        assert not waiter.done()  # the freed slot was borrowed reserve: it goes back to VIP, not to batch
        waiter.cancel()
    run(main())


def test_standard_may_burst_batch_may_not_and_priority_order_on_release():
    async def main():
        lanes = Lanes(default_lanes(), 20)
        await lanes.acquire("vip", "acme")  # VIP busy: no borrowing of the reserve
        for _ in range(15):
            await lanes.acquire("batch", "b")
        std = asyncio.create_task(lanes.acquire("standard", "s"))
        await asyncio.sleep(0)
        assert std.done()  # the burst pool
        more_batch = asyncio.create_task(lanes.acquire("batch", "b"))
        more_std = asyncio.create_task(lanes.acquire("standard", "s"))
        await asyncio.sleep(0)
        assert not more_batch.done() and not more_std.done()
        lanes.release("batch")
        await spin()
        assert more_std.done() and not more_batch.done()  # the more important lane is served first
        more_batch.cancel()
    run(main())


def test_fair_queueing_round_robin_between_tenants():
    async def main():
        lanes = Lanes({"std": LaneConfig(priority=1)}, 1, CapacityConfig(reserved_share=0, burst_share=0))
        await lanes.acquire("std", "holder")
        order: list[str] = []

        async def one(tenant: str) -> None:
            await lanes.acquire("std", tenant)
            order.append(tenant)

        tasks = [asyncio.create_task(one("flood")) for _ in range(4)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("small")) for _ in range(2)]
        await asyncio.sleep(0)
        for _ in range(6):
            lanes.release("std")
            await spin()
        await asyncio.gather(*tasks)
        assert order == ["flood", "small", "flood", "small", "flood", "flood"]
    run(main())


def test_bounded_queue_and_deadline_give_429_with_retry_after():
    async def main():
        cfg = LaneConfig(max_queue=2, max_queue_wait_s=0.05)
        lanes = Lanes({"std": cfg}, 1, CapacityConfig(reserved_share=0, burst_share=0))
        await lanes.acquire("std")
        waiting = [asyncio.create_task(lanes.acquire("std")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await lanes.acquire("std")
        assert 1 <= full.value.retry_after <= 60
        for t in waiting:
            with pytest.raises(Overloaded):
                await t  # past the 50 ms deadline
        snap = lanes.snapshot()["std"]
        assert snap["waiting"] == 0 and snap["in_use"] == 1 and snap["refused"] == 3
    run(main())


def _drained_lane(max_queue_wait_s: float, waiters: int, gap_s: float, admitted: int = 8, slots: int = 1,
                  max_queue: int = 100):
    """A lane of ``slots`` slots, held by tenant "flood", with ``waiters`` of its requests queued at t=0 and one
    admitted from the queue every ``gap_s`` seconds, ``admitted`` times (the lanes' clock is the returned list)."""
    cfg = LaneConfig(max_queue=max_queue, max_queue_wait_s=max_queue_wait_s)
    lanes = Lanes({"std": cfg}, slots, CapacityConfig(reserved_share=0, burst_share=0, drain_window_s=10))
    now = [0.0]
    lanes.clock = lambda: now[0]

    async def build() -> list[asyncio.Task]:
        for _ in range(slots):
            await lanes.acquire("std", "flood")
        tasks = [asyncio.create_task(lanes.acquire("std", "flood")) for _ in range(waiters)]
        await spin()
        for _ in range(admitted):
            now[0] += gap_s
            lanes.release("std")
            await spin()
        return tasks

    return lanes, now, build


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """End the waiters a test left queued."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_refused_at_once_when_the_drain_rate_says_the_deadline_cannot_be_met():
    async def main():
        # 8 admissions from the queue, 1.25 s apart: 0.8/s, so a request behind the one still waiting would wait
        # about (1 + 1) / 0.8 = 2.5 s, past its 1 s deadline.
        lanes, now, build = _drained_lane(1.0, waiters=9, gap_s=1.25)
        tasks = await build()
        with pytest.raises(Overloaded) as exc:
            await lanes.acquire("std", "flood")
        assert exc.value.retry_after == 3  # ceil(2.5)
        assert lanes.lanes["std"].waiting == 1  # it never took a queue place
        await _cancel_all(tasks)
    run(main())


def test_the_drain_rate_counts_only_time_when_requests_waited():
    """Admissions of requests that never waited say how fast they came, not how fast the lane drains; the idle time
    between two busy spells is no gap. After an idle spell a burst drained at 10/s reads 10/s (it read 8 admissions
    per 10 s window, 0.8/s, and refused a newcomer as 31 s late while the burst was through in 3 s)."""
    async def main():
        lanes, now, build = _drained_lane(5.0, waiters=20, gap_s=0.1, slots=2)
        for _ in range(30):  # a long quiet history of requests admitted at once
            await lanes.acquire("std", "early")
            lanes.release("std")
        now[0] = 100.0
        tasks = await build()
        assert lanes.drain_rate(lanes.lanes["std"], now[0]) == pytest.approx(10.0)
        await _cancel_all(tasks)
    run(main())


def test_one_tenants_queue_is_not_ahead_of_another_tenants_request():
    """Tenants are served in turn, so a newcomer of another tenant waits for one of the flood's requests, not all
    of them: its estimate (0.2 s at 10/s) is far inside a deadline the whole queue (1.3 s) would miss."""
    async def main():
        lanes, now, build = _drained_lane(1.0, waiters=20, gap_s=0.1)
        tasks = await build()
        assert lanes.lanes["std"].waiting == 12
        own = asyncio.create_task(lanes.acquire("std", "alice"))
        await spin()
        assert not own.done()  # queued, not refused
        with pytest.raises(Overloaded, match="past its 1 s deadline"):
            await lanes.acquire("std", "flood")  # the flood's own next one would wait behind all of its own
        now[0] += 0.1
        lanes.release("std")
        await spin()
        now[0] += 0.1
        lanes.release("std")
        await spin()
        assert own.done() and own.exception() is None  # admitted second: one of the flood's, then alice
        await _cancel_all(tasks)
    run(main())


def test_a_full_lane_refuses_the_heaviest_tenants_newest_request_not_a_newcomer():
    async def main():
        lanes, now, build = _drained_lane(30.0, waiters=10, gap_s=0.1, admitted=0, max_queue=10)
        flood = await build()
        alice = asyncio.create_task(lanes.acquire("std", "alice"))
        await spin()
        assert not alice.done() and lanes.lanes["std"].waiting == 10
        assert flood[-1].done() and isinstance(flood[-1].exception(), Overloaded)  # the flood's newest gave way
        assert "most of its waiting requests are this caller's" in str(flood[-1].exception())
        assert not any(t.done() for t in flood[:-1])
        with pytest.raises(Overloaded, match="is full"):  # the flood itself is refused as before
            await lanes.acquire("std", "flood")
        lanes.release("std")
        await spin()
        assert sum(t.done() and t.exception() is None for t in flood) == 1  # the round: the flood's head first
        lanes.release("std")
        await spin()
        assert alice.done() and alice.exception() is None
        await _cancel_all(flood)
    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_releases_admit_the_next():
    async def main():
        lanes = Lanes({"std": LaneConfig()}, 1, CapacityConfig(reserved_share=0, burst_share=0))
        await lanes.acquire("std")
        gone = asyncio.create_task(lanes.acquire("std", "a"))
        stays = asyncio.create_task(lanes.acquire("std", "b"))
        await asyncio.sleep(0)
        gone.cancel()
        await spin()
        assert lanes.lanes["std"].waiting == 1
        lanes.release("std")
        await asyncio.wait_for(stays, 1)
        assert lanes.lanes["std"].in_use == 1
    run(main())


# --- tenants --------------------------------------------------------------------------------------------------------
def test_key_file_round_trip_keeps_only_hashes(tmp_path):
    path = tmp_path / "keys.yaml"
    kf = KeyFile()
    key = kf.add_key("acme", "vip", requests_per_s=5.0)
    kf.save(path)
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    tenants = Tenants.load(path)
    t = tenants.lookup(key)
    assert t is not None and t.name == "acme" and t.lane == "vip"
    assert tenants.lookup("tg-wrong") is None and tenants.lookup(None) is None
    path.write_text("tenants: {}\nkeys: [{sha256: " + "a" * 64 + ", tenant: ghost}]\n")
    with pytest.raises(ValueError, match="ghost"):
        KeyFile.load(path)


def test_token_bucket_and_tenant_limits():
    b = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    assert [b.take(1, now=0.0) for _ in range(4)] == [0.0] * 4
    assert b.take(1, now=0.0) == pytest.approx(0.5)
    assert b.take(1, now=0.5) == 0.0
    t = Tenant("acme", TenantConfig(requests_per_s=1, burst_s=1), now=0.0)
    t.charge(10, now=0.0)
    with pytest.raises(RateLimited, match="request rate") as exc:
        t.charge(10, now=0.5)  # half a request saved up
    assert exc.value.retry_after == 1
    t.charge(10, now=1.0)
    t = Tenant("acme", TenantConfig(tokens_per_s=100, burst_s=1), now=0.0)
    t.charge(60, now=0.0)
    with pytest.raises(RateLimited, match="token rate"):
        t.charge(60, now=0.1)  # 40 left + 10 refilled < 60
    t.refund(20)  # output charged but never produced
    t.charge(60, now=0.1)


def test_breaker_opens_after_failures_and_half_opens_after_cooldown():
    br = CircuitBreaker(failures=3, cooldown_s=0.05)
    for _ in range(2):
        br.failure()
    assert br.allows() and br.state == "closed"
    br.failure()
    assert br.state == "open" and not br.allows()
    import time

    time.sleep(0.06)
    assert br.state == "half_open" and br.allows()
    br.begin()
    assert not br.allows()  # one trial at a time
    br.failure()
    assert br.state == "open"
    time.sleep(0.06)
    br.begin()
    br.success()
    assert br.state == "closed" and br.allows()


# --- routing ----------------------------------------------------------------------------------------------------------
def _pool(n: int, policy: str = "least_tokens") -> UpstreamPool:
    ups = [UpstreamConfig(url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]
    return UpstreamPool(ups, RoutingConfig(policy=policy), rng=random.Random(7))


def test_power_of_two_choices_prefers_the_lighter_replica():
    pool = _pool(3)
    pool.replicas[0].outstanding_tokens = 5000
    pool.replicas[1].outstanding_tokens = 10
    pool.replicas[2].outstanding_tokens = 4000
    picks = [pool.pick().name for _ in range(300)]
    assert picks.count(pool.replicas[0].name) == 0  # the heaviest never wins a pair
    assert picks.count(pool.replicas[1].name) > 150
    pool.replicas[1].healthy = False
    assert pool.replicas[1].name not in {pool.pick().name for _ in range(50)}
    assert pool.pick(exclude={pool.replicas[2].name}).name == pool.replicas[0].name


def test_prefix_affinity_is_stable_and_yields_to_load():
    pool = _pool(4, "prefix")
    key = pool.affinity_key(None, "You are a helpful assistant. " * 10)
    chosen = {pool.pick(key).name for _ in range(20)}
    assert len(chosen) == 1
    keys = [pool.affinity_key(f"session-{i}", "") for i in range(200)]
    spread = {pool.pick(k).name for k in keys}
    assert len(spread) == 4  # sessions spread over every replica
    (name,) = chosen
    busy = next(r for r in pool.replicas if r.name == name)
    busy.outstanding_tokens = 100_000
    assert pool.pick(key).name != name  # bounded load: affinity gives way


# --- the stall watch ------------------------------------------------------------------------------------------------
class _Ev:
    def __init__(self, token_id, finished=False):
        self.token_id = token_id
        self.finished = finished


async def _scripted(gaps: list[float], closed: list[bool]):
    try:
        for g in gaps:
            await asyncio.sleep(g)
            yield _Ev(1)
        yield _Ev(None, finished=True)
    finally:
        closed.append(True)


def test_watch_passes_on_time_streams_and_stalls_after_consecutive_misses():
    async def main():
        closed: list[bool] = []
        got = [e async for e in watch(_scripted([0.0, 0.01, 0.01], closed), ttft_deadline=0.2, itl_deadline=0.2)]
        assert len(got) == 4 and closed == [True]
        closed.clear()
        misses: list[str] = []
        with pytest.raises(Stalled) as exc:
            async for _ in watch(_scripted([0.0, 0.01, 5.0], closed), ttft_deadline=0.2, itl_deadline=0.03,
                                 misses=3, on_miss=misses.append):
                pass
        assert misses == ["itl"] * 3 and not exc.value.before_first_token
        assert closed == [True]  # the backend's stream was closed (its request aborted)
    run(main())


def test_watch_late_tokens_keep_the_streak_and_keepalives_come_before_the_first_token():
    async def main():
        closed: list[bool] = []
        with pytest.raises(Stalled):
            # Each gap misses its deadline once: a late token does not clear the streak.
            async for _ in watch(_scripted([0.0, 0.05, 0.05, 0.05], closed), ttft_deadline=1, itl_deadline=0.03):
                pass
        out = [e async for e in watch(_scripted([0.12, 0.0], []), ttft_deadline=None, itl_deadline=None,
                                      keepalive=0.05)]
        # Every keep-alive comes before the first token: two at most in 0.12 s (one when a loaded machine's loop
        # lags, the second ping is re-armed from when the first was actually sent).
        pings = sum(e is KEEPALIVE for e in out)
        assert 1 <= pings <= 2 and all(e is KEEPALIVE for e in out[:pings]) and len(out) == pings + 3
    run(main())


def test_watch_closed_while_waiting_for_the_first_token_closes_the_backend_stream_at_once():
    async def main():
        closed: list[bool] = []
        agen = watch(_scripted([30.0], closed), ttft_deadline=None, itl_deadline=None, keepalive=0.01)
        assert await agen.__anext__() is KEEPALIVE  # the read for the first token is still running
        t0 = asyncio.get_running_loop().time()
        await agen.aclose()
        assert closed == [True] and asyncio.get_running_loop().time() - t0 < 1.0
    run(main())


def test_watch_without_an_inter_token_deadline_passes_late_tokens_after_the_first():
    async def main():
        closed: list[bool] = []
        misses: list[str] = []
        got = [e async for e in watch(_scripted([0.0, 0.08, 0.08], closed), ttft_deadline=0.02, itl_deadline=None,
                                      on_miss=misses.append)]
        assert len(got) == 4 and misses == [] and closed == [True]
    run(main())


def test_watch_keeps_the_ttft_clock_across_the_replicas_head():
    """The replica's head (``accepted``, not a token) neither restarts the TTFT deadline nor clears the streak: the
    deadlines stay counted from the request's start (0.5 and 1.0 s here, not 0.5 and 1.25 s after a head at 0.75 s)."""
    class _Head(_Ev):
        accepted = True

    async def head_then_silence():
        await asyncio.sleep(0.75)
        yield _Head(None)
        await asyncio.sleep(30)
        yield _Ev(1)

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        at: list[float] = []
        got = []
        with pytest.raises(Stalled) as exc:
            async for ev in watch(head_then_silence(), ttft_deadline=0.5, itl_deadline=None, misses=2,
                                  on_miss=lambda kind: at.append(loop.time() - t0)):
                got.append(ev)
        assert [type(e) for e in got] == [_Head] and exc.value.before_first_token
        assert len(at) == 2 and at[1] < 1.2, at
    run(main())


# --- the upstream's SSE bytes ---------------------------------------------------------------------------------------
def _chat_chunk(delta: dict, finish: str | None = None, **extra) -> dict:
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


_PAYLOADS = [  # (payload, chat); compact and spaced JSON, escapes, non-ASCII, the chunks around the tokens
    (json.dumps(_chat_chunk({"role": "assistant", "content": ""})), True),
    (json.dumps(_chat_chunk({"content": "plain"}), separators=(",", ":")), True),
    (json.dumps(_chat_chunk({"content": "spaced"})), True),
    (json.dumps(_chat_chunk({"content": 'say "hi"\n\tback\\slash'})), True),
    (json.dumps(_chat_chunk({"content": "h\u00e9llo \U0001f600"}), ensure_ascii=False), True),
    (json.dumps(_chat_chunk({"content": "h\u00e9llo \U0001f600"})), True),
    (json.dumps(_chat_chunk({"reasoning_content": "thinking"})), True),
    (json.dumps(_chat_chunk({"content": "last"}, "length")), True),
    (json.dumps(_chat_chunk({"content": None}, "stop")), True),
    (json.dumps(_chat_chunk({"content": "tok"}, usage=None)), True),
    (json.dumps({**_chat_chunk({"content": "u"}), "usage": {"prompt_tokens": 3, "completion_tokens": 2}}), True),
    (json.dumps({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}), True),
    (json.dumps({"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None},
                                        {"index": 1, "delta": {"content": "b"}, "finish_reason": None}]}), True),
    (json.dumps({"error": {"message": "out of memory", "code": 500}}), True),
    (json.dumps({"id": "c", "object": "text_completion", "choices": [
        {"index": 0, "text": "once", "logprobs": None, "finish_reason": None}]}), False),
    (json.dumps({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}), False),
]


def test_token_text_fast_path_agrees_with_the_full_parse():
    fast_taken = 0
    for payload, chat in _PAYLOADS:
        raw = payload.encode()
        full = read_chunk(raw, chat)
        fast = token_text(raw, chat)
        if fast is not None:
            fast_taken += 1
            assert (fast or None) == full.text and full.finish_reason is None and full.usage is None, payload
    # The plain chunks skip the parse: the role chunk (no token: "") and the token chunks (both JSON spacings,
    # escapes, raw and escaped non-ASCII, "usage": null, a completion).
    assert token_text(_PAYLOADS[0][0].encode(), True) == ""
    assert fast_taken == 8
    assert read_chunk(_PAYLOADS[7][0].encode(), True).finish_reason == "length"
    assert read_chunk(_PAYLOADS[11][0].encode(), True).usage == {"prompt_tokens": 3, "completion_tokens": 2}
    assert read_chunk(_PAYLOADS[12][0].encode(), True).text == "ab"
    assert read_chunk(_PAYLOADS[13][0].encode(), True).error == "out of memory"
    with pytest.raises(ValueError):
        read_chunk(b"{not json", True)


def test_sse_lines_give_the_same_payloads_however_the_reads_cut_the_stream():
    events = [p for p, chat in _PAYLOADS if chat] + ["[DONE]"]
    stream = "".join(f"data: {p}\n\n" for p in events[:5]) + ": a comment\n\nevent: x\r\n" + "".join(
        f"data:{p}\r\n\r\n" for p in events[5:])
    data = stream.encode()
    whole = SSELines().feed(data)
    assert [p.decode() for p in whole] == events
    for size in (1, 2, 3, 7, 64):
        lines = SSELines()
        got = [p for i in range(0, len(data), size) for p in lines.feed(data[i:i + size])]
        assert got == whole, size
        assert lines.pending == b""
    lines = SSELines()
    assert lines.feed(b'data: {"a"') == [] and lines.pending == b'data: {"a"'
    assert lines.feed(b": 1}\n") == [b'{"a": 1}']


@pytest.mark.parametrize("payload", [
    b'{"choices": [5]}', b'{"choices": "abc"}', b'{"choices": [{"delta": {"content": 5}}]}',
    b'{"choices": [{"delta": "x"}]}', b'{"choices": [{"delta": {}, "finish_reason": {"a": 1}}]}',
])
def test_a_chunk_of_the_wrong_shape_is_refused_as_unparsable(payload):
    with pytest.raises(ValueError):
        read_chunk(payload, chat=True)


def test_usage_counts_that_cannot_be_true_are_dropped():
    for bad in ('"abc"', "-20", "1e30", "1000000000000000000000000000000", "true", "[1]"):
        chunk = read_chunk(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": %s}}' % bad.encode(),
                           chat=True)
        assert chunk.usage == {"prompt_tokens": 3}, bad
    assert read_chunk(b'{"choices": [], "usage": "lots"}', chat=True).usage is None
    good = read_chunk(b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, '
                      b'"prompt_tokens_details": {"cached_tokens": 2}}}', chat=True)
    assert good.usage == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 2}}


def test_a_line_that_never_ends_is_refused_at_its_limit_in_linear_time():
    lines = SSELines(max_line=1 << 20)
    piece = b"x" * 65536
    lines.feed(b"data: ")
    for _ in range(15):  # 15 x 64 KiB: under the limit, buffered, each read scanned once
        assert lines.feed(piece) == []
    with pytest.raises(SSELineTooLong):
        lines.feed(piece + piece)
    # A long line that ends within the limit is a payload like any other.
    ok = SSELines(max_line=1 << 20)
    assert ok.feed(b"data: " + piece) == [] and ok.feed(b"\n") == [piece]
    # And a read that ends a line over the limit is refused too, not passed on.
    with pytest.raises(SSELineTooLong):
        SSELines(max_line=1000).feed(b"data: " + b"y" * 2000 + b"\n")


def test_token_texts_learn_the_streams_plain_shape_and_still_agree_with_the_parse():
    texts = TokenTexts(chat=True)
    plain = [json.dumps(_chat_chunk({"content": t})).encode() for t in ("one", "two", 'a "q"', "caf\u00e9\\", "x")]
    tricky = [  # the same bytes around, yet not a plain chunk: quotes in between mean other fields
        json.dumps(_chat_chunk({"content": "y", "role": "z"})).encode(),
        json.dumps(_chat_chunk({"content": ""})).encode(),
        json.dumps(_chat_chunk({"content": "end"}, "stop")).encode(),
    ]
    for payload in plain + tricky + plain:
        got = texts(payload)
        full = read_chunk(payload, True)
        if got is not None:
            assert (got or None) == full.text and full.finish_reason is None, payload
        else:
            assert payload in tricky, payload
    assert [texts(p) for p in plain] == ["one", "two", 'a "q"', "caf\u00e9\\", "x"]
    # Built by hand: head and tail as learned, and a middle that ends the string early.
    head, tail = b'{"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "m", ' \
        b'"choices": [{"index": 0, "delta": {"content": "', b'"}, "logprobs": null, "finish_reason": null}]}'
    forged = head + b'a", "role": "b' + tail
    assert texts(forged) == read_chunk(forged, True).text == "a"  # not the bytes between head and tail


# What each engine's /metrics says about its queue (the names as those servers print them; labels and HELP lines
# included). The gate reads waiting and running; an engine with neither gauge is invisible to it.
@pytest.mark.parametrize(("text", "expected"), [
    (b'# HELP vllm:num_requests_waiting Number of requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n'
     b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\nvllm:num_requests_running{engine="0",model_name="m"} 8.0\n',
     (3.0, 8.0)),
    (b'sglang:num_queue_reqs{model_name="m"} 5\nsglang:num_running_reqs{model_name="m"} 16\n', (5.0, 16.0)),
    (b'# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 4\n'
     b'# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 2\n', (2.0, 4.0)),
    (b'tailguard_num_requests_waiting{model="a"} 1.0\ntailguard_num_requests_waiting{model="b"} 2.0\n'
     b'tailguard_num_requests_running{model="a"} 4.0\n', (3.0, 4.0)),
    (b'vllm:num_requests_running{engine="0"} 8.0\n', (None, None)),  # running alone: no queue figure
    (b'# HELP vllm:num_requests_waiting x\nsome_other_metric 7\n', (None, None)),
])
def test_queue_gauges_of_each_engine(text, expected):
    assert queue_gauges(text) == expected



def test_a_replica_that_preempts_must_be_sent_the_priority_it_preempts_by():
    """``preempts`` (the gateway lends the VIP reserve over such replicas) means nothing without ``send_priority``:
    a config that says so is refused when it loads, not discovered when VIP waits behind batch."""
    with pytest.raises(ValueError, match="needs send_priority"):
        UpstreamConfig(url="http://127.0.0.1:9", preempts=True)
    cfg = UpstreamConfig(url="http://127.0.0.1:9", send_priority=True, preempts=True)
    assert cfg.preempts and cfg.send_priority
    assert not UpstreamConfig(url="http://127.0.0.1:9", send_priority=True).preempts  # vLLM's case: the default


def test_the_upstream_request_id_is_uuid5_of_ours() -> None:
    import uuid

    from tailguard.backends.upstream.proxy import _upstream_request_id

    for rid in ("chatcmpl-0123abcd", "x", "é漢字-1"):
        assert _upstream_request_id("uuid", rid) == str(uuid.uuid5(uuid.NAMESPACE_URL, "tailguard:" + rid))
    assert _upstream_request_id("same", "x") == "x" and _upstream_request_id("off", "x") is None


def test_replica_totals_reach_the_prometheus_counters_once() -> None:
    """Breaker openings and the connection pool's counts are running totals on the replica: each sample adds what
    is new, never twice."""
    from prometheus_client import CollectorRegistry

    from tailguard.observe.gateway_metrics import GatewayMetrics
    from tailguard.serving.state import sample_gateway

    reg = CollectorRegistry()
    gm = GatewayMetrics(reg, "m")
    pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:9", name="a")])
    rep = pool.replicas[0]
    rep.breaker.opened_total, rep.conns.opened, rep.conns.opened_on_demand, rep.conns.reconnects = 1, 5, 2, 1
    sample_gateway(gm, None, pool)
    sample_gateway(gm, None, pool)
    rep.breaker.opened_total, rep.conns.opened = 3, 9
    sample_gateway(gm, None, pool)

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, {"model": "m", "replica": "a", **labels})

    assert value("tailguard_upstream_breaker_opened_total") == 3
    assert value("tailguard_upstream_connections_opened_total", kind="ahead") == 7
    assert value("tailguard_upstream_connections_opened_total", kind="on_demand") == 2
    assert value("tailguard_upstream_resent_requests_total") == 1


def test_credentials_in_an_upstream_url_are_never_shown() -> None:
    pool = UpstreamPool([UpstreamConfig(url="http://ann:secret@10.0.0.1:8000/v1")])
    rep = pool.replicas[0]
    assert rep.name == "10.0.0.1:8000" and rep.url == "http://ann:secret@10.0.0.1:8000"
    assert pool.describe()[0]["url"] == "http://10.0.0.1:8000"
    assert rep.conns.basic_auth is not None  # still sent upstream


def test_a_traced_request_is_not_written_ahead(monkeypatch):
    """Its span's context must travel in the request, and the span is made by the attempt: the attempt sends it."""
    from tailguard.backends.upstream.pool import NoReplica
    from tailguard.backends.upstream.proxy import UpstreamBackend
    from tailguard.backends.upstream.quarantine import Quarantine
    from tailguard.observe import tracing

    class Pool:  # reached only when the request may be written ahead
        picked = 0
        quarantine = Quarantine()  # holds nothing: no request is refused

        def pick(self, key, exclude):
            Pool.picked += 1
            raise NoReplica("none")

    backend = UpstreamBackend(Pool())  # type: ignore[arg-type]
    monkeypatch.setattr(tracing, "current_trace", lambda: object())
    assert backend.open({}, True, "r") is None and Pool.picked == 0
    monkeypatch.setattr(tracing, "current_trace", lambda: None)
    assert backend.open({}, True, "r") is None and Pool.picked == 1  # untraced: it tries (no replica here)


def test_replica_names_are_unique_and_fit_a_url_path():
    """Two replicas of one host get names a DELETE /admin/upstreams/{name} can carry (a "#" suffix was cut off as a
    URL fragment, and the other replica removed) and that stay unique after removals."""
    pool = UpstreamPool([UpstreamConfig(url="http://127.0.0.1:8000"), UpstreamConfig(url="http://u:pw@127.0.0.1:8000"),
                         UpstreamConfig(url="http://127.0.0.1:8000/b")], RoutingConfig())
    names = [r.name for r in pool.replicas]
    assert names == ["127.0.0.1:8000", "127.0.0.1:8000-2", "127.0.0.1:8000/b"]
    assert not any(c in n for n in names for c in "#?")
    pool.remove("127.0.0.1:8000")
    pool._new(UpstreamConfig(url="http://127.0.0.1:8000/c", name="127.0.0.1:8000-2"))
    pool._new(UpstreamConfig(url="http://127.0.0.1:8000/d", name="127.0.0.1:8000-2"))
    names = [r.name for r in pool.replicas]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("url, why", [
    ("htp://admin:TYPOSECRET@10.0.0.5:8000", "must start with http"),
    ("admin:TYPOSECRET@10.0.0.5:8000", "must start with http"),
    ("http://admin:TYPOSECRET@10.0.0.5:8000/?x=1", "without a query or a fragment"),
    ("http://admin:TYPOSECRET@10.0.0.5:8000#a", "without a query or a fragment"),
])
def test_a_bad_upstream_url_is_refused_without_printing_its_password(url, why):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=why) as exc:
        UpstreamConfig(url=url)
    # What the CLI and the admin API show of it: the messages, without the input.
    assert "TYPOSECRET" not in str(exc.value.errors(include_input=False, include_url=False))


def test_a_newcomer_that_would_miss_its_deadline_takes_no_place_from_a_full_lane():
    """The heaviest tenant's newest request gives way only to a request that will take its place: one refused for its
    deadline leaves the queue as it was (both were refused, and the queue left one short)."""
    async def main():
        lanes, now, build = _drained_lane(1.0, waiters=10, gap_s=1.25, admitted=0, max_queue=10)  # full
        flood = await build()
        std = lanes.lanes["std"]
        std.gaps.extend((now[0], 1.25) for _ in range(8))  # a drain history of 0.8 admissions a second
        assert std.waiting == 10
        with pytest.raises(Overloaded, match="past its 1 s deadline"):
            await lanes.acquire("std", "alice")
        await spin()
        assert std.waiting == 10 and not any(t.done() for t in flood)
        await _cancel_all(flood)
    run(main())
