"""The scripted engine's cost model: slots taken most important first (the lowest priority value) when asked to (first come, first served
otherwise), and decode gaps that grow with the batch, as a real engine's steps do."""

from __future__ import annotations

import asyncio
import time

from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.sequence import FinishReason, SamplingParams


async def _run(engine: FakeEngine, rid: str, priority: int, order: list[str], tokens: int = 3) -> list[float]:
    times = []
    async for ev in engine.generate([5, 6, 7], SamplingParams(max_tokens=tokens), rid, priority=priority):
        if ev.token_id is not None:
            times.append(ev.time)
        if ev.finished and ev.finish_reason is not FinishReason.ABORT:
            order.append(rid)
    return times


def _admission_order(priority_scheduling: bool) -> list[str]:
    async def main() -> list[str]:
        engine = FakeEngine(FakeTiming(ttft=0.02, itl=0.002, max_num_seqs=1, priority_scheduling=priority_scheduling))
        order: list[str] = []
        first = asyncio.create_task(_run(engine, "holder", 2, order))
        await asyncio.sleep(0.005)  # the one slot is taken; the rest queue in this order
        rest = [asyncio.create_task(_run(engine, rid, prio, order))
                for rid, prio in (("batch-1", 2), ("batch-2", 2), ("vip", 0), ("standard", 1))]
        await asyncio.gather(first, *rest)
        return order
    return asyncio.run(main())


def test_slots_go_most_important_first_when_asked():
    assert _admission_order(True) == ["holder", "vip", "standard", "batch-1", "batch-2"]
    assert _admission_order(False) == ["holder", "batch-1", "batch-2", "vip", "standard"]


def test_an_aborted_waiter_gives_its_place_up():
    async def main() -> list[str]:
        engine = FakeEngine(FakeTiming(ttft=0.03, itl=0.001, max_num_seqs=1, priority_scheduling=True))
        order: list[str] = []
        first = asyncio.create_task(_run(engine, "holder", 0, order))
        await asyncio.sleep(0.005)
        gone = asyncio.create_task(_run(engine, "gone", 0, order))
        after = asyncio.create_task(_run(engine, "after", 1, order))
        await asyncio.sleep(0.005)
        engine.abort("gone")
        await asyncio.gather(first, gone, after)
        return order
    order = asyncio.run(main())
    assert order == ["holder", "after"]  # the aborted one never ran, and did not hold the slot


def test_decode_gaps_grow_with_the_batch():
    def median_gap(streams: int) -> float:
        async def main() -> list[list[float]]:
            engine = FakeEngine(FakeTiming(ttft=0.0, itl=0.004, itl_per_running=0.002, max_num_seqs=64))
            return await asyncio.gather(*[_run(engine, f"r{i}", 0, [], tokens=6) for i in range(streams)])
        runs = asyncio.run(main())
        gaps = sorted(b - a for times in runs for a, b in zip(times, times[1:]))
        return gaps[len(gaps) // 2]
    one, eight = median_gap(1), median_gap(8)
    # 4 ms alone; 4 + 7 x 2 = 18 ms beside 7 others (generous margins: a shared machine's timers)
    assert one < 0.012 and eight > 0.012, (one, eight)


def test_without_the_model_nothing_changes():
    t = FakeTiming()
    assert t.itl_per_running == 0.0 and t.priority_scheduling is False
    start = time.perf_counter()
    asyncio.run(_run(FakeEngine(FakeTiming(ttft=0.0, itl=0.001)), "x", 0, []))
    assert time.perf_counter() - start < 1.0
