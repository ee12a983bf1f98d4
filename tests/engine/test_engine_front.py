"""The engine's thread front ends every request: crashes, shutdown, a dead consumer loop, late registrations."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from tailguard.engine.engine import MAX_FAILED_STEPS, AsyncLLMEngine, EngineArgs, EngineClosed, LLMEngine
from tailguard.engine.sequence import SamplingParams


@pytest.fixture
def engine(tiny_gguf):
    return LLMEngine(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=4096, max_model_len=512, num_threads=1))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _drain(front: AsyncLLMEngine, rid: str, n: int = 200) -> tuple[int, BaseException | None]:
    got = 0
    try:
        async for _ in front.generate([1, 2, 3, 4, 5], greedy(n), rid):
            got += 1
    except EngineClosed as exc:
        return got, exc
    return got, None


def _fail_steps(engine: LLMEngine, fails: Callable[[int], bool], message: str) -> dict[str, int]:
    """Make the engine's n-th step (counted from 1) raise wherever ``fails(n)``; returns the live step count."""
    steps = {"n": 0}
    real_step = engine.step

    def step():
        steps["n"] += 1
        if fails(steps["n"]):
            raise RuntimeError(message)
        return real_step()

    engine.step = step
    return steps


def test_steps_failing_in_a_row_outside_the_model_end_every_request_and_refuse_new_ones(engine):
    front = AsyncLLMEngine(engine)
    # The scheduler itself is broken: every step from the fifth on fails.
    steps = _fail_steps(engine, lambda n: n >= 5, "injected scheduler failure")

    async def main():
        results = await asyncio.wait_for(asyncio.gather(*(_drain(front, f"crash-{i}") for i in range(4))), 30)
        with pytest.raises(EngineClosed, match="injected scheduler failure"):
            await asyncio.wait_for(_drain_raise(front, "late"), 5)
        return results

    results = asyncio.run(main())
    assert all(isinstance(exc, EngineClosed) and "injected scheduler failure" in str(exc) for _, exc in results)
    assert all(got < 200 for got, _ in results)
    assert steps["n"] == 4 + MAX_FAILED_STEPS  # retried, then given up on (and said: error set, not running)
    assert front.error is not None and not front.is_running


def test_one_step_failing_outside_the_model_is_retried_and_nobody_notices(engine):
    front = AsyncLLMEngine(engine)
    _fail_steps(engine, lambda n: n == 5, "injected one-off failure")

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(_drain(front, f"flaky-{i}", 20) for i in range(3))), 30)

    results = asyncio.run(main())
    assert results == [(20, None)] * 3
    assert front.error is None and front.is_running
    front.shutdown()


def test_predicted_ttft_counts_prompts_submitted_while_a_step_runs(engine):
    """The engine thread takes new requests between steps: one submitted during a step is in no queue of the
    scheduler's yet, and still counts ahead of a prompt predicted after it (of its priority or a less important
    one)."""
    front = AsyncLLMEngine(engine)
    in_step, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        if engine.scheduler.running:
            in_step.set()
            release.wait(10)
        return real_step()

    engine.step = held_step

    async def main() -> tuple[float, float, float]:
        running = asyncio.create_task(_drain(front, "running", 8))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        before = front.predict_ttft(50, priority=1)
        queued = asyncio.create_task(_drain_raise(front, "queued", prompt=list(range(1, 301)), priority=1))
        await asyncio.sleep(0.05)  # its "add" is queued for the engine thread, held in the step
        during = front.predict_ttft(50, priority=1)
        ahead_of_it = front.predict_ttft(50, priority=0)
        release.set()
        await asyncio.wait_for(asyncio.gather(running, queued), 30)
        return before, during, ahead_of_it

    before, during, ahead_of_it = asyncio.run(main())
    assert during > before and ahead_of_it == pytest.approx(before)
    assert front._submitted == {}  # taken in by the engine thread
    front.shutdown()


async def _drain_raise(front: AsyncLLMEngine, rid: str, prompt: list[int] | None = None, priority: int = 0) -> None:
    async for _ in front.generate(prompt or [1, 2, 3], greedy(4), rid, priority=priority):
        pass


def test_shutdown_ends_streams_in_flight_with_an_error_and_frees_their_blocks(engine):
    front = AsyncLLMEngine(engine)

    async def main():
        started = asyncio.Event()

        async def consume(rid):
            got = 0
            try:
                async for _ in front.generate([1, 2, 3, 4], greedy(400), rid):
                    got += 1
                    if got == 2:
                        started.set()
            except EngineClosed as exc:
                return got, str(exc)
            return got, None

        tasks = [asyncio.create_task(consume(f"sd-{i}")) for i in range(3)]
        await asyncio.wait_for(started.wait(), 20)
        await asyncio.get_running_loop().run_in_executor(None, front.shutdown)
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    results = asyncio.run(main())
    assert [reason for _, reason in results] == ["engine shut down"] * 3
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_a_consumer_whose_event_loop_closed_does_not_take_the_engine_down(engine):
    front = AsyncLLMEngine(engine)
    # A consumer on its own event loop, in its own thread, that closes its loop while its request is running.
    registered = threading.Event()

    def orphan():
        loop = asyncio.new_event_loop()

        async def start():
            agen = front.generate([7, 8, 9], greedy(300), "orphan")
            await agen.__anext__()
            registered.set()
            return agen

        loop.run_until_complete(start())
        loop.close()  # the generator is never closed: its tokens now have nowhere to go

    t = threading.Thread(target=orphan)
    t.start()
    t.join(20)
    assert registered.is_set()

    async def main():
        return await asyncio.wait_for(_drain(front, "survivor", 20), 30)

    got, exc = asyncio.run(main())
    assert exc is None and got == 20, "the engine must keep serving others"
    assert front.is_running and front.error is None
    front.shutdown()
    assert engine.pool.num_used == 0


def test_timestamps_stay_on_one_monotonic_clock_across_the_thread(engine):
    import time

    front = AsyncLLMEngine(engine)

    async def main():
        sent = time.perf_counter()
        events = [ev async for ev in front.generate([5, 6, 7], greedy(6), "clock", arrival_time=sent)]
        return sent, events, time.perf_counter()

    sent, events, done = asyncio.run(main())
    front.shutdown()
    last = events[-1]
    assert sent == last.arrival <= last.first_scheduled <= last.first_token <= last.time <= done
    times = [ev.time for ev in events]
    assert times == sorted(times)


@pytest.mark.parametrize("grace, expected", [(0.5, 1), (0.0, 0), (30.0, 30)])
def test_a_short_graceful_shutdown_never_means_wait_forever(tmp_path, grace, expected):
    from tailguard.serving.server import _uvicorn_config
    from tests.serving_helpers import make_config

    config = make_config(tmp_path, graceful_shutdown_s=grace)
    assert _uvicorn_config(object(), config).timeout_graceful_shutdown == expected


def test_a_request_to_a_stopped_engine_gets_a_503_not_a_500(tmp_path, engine):
    import httpx

    from tailguard.serving.app import create_app
    from tests.serving_helpers import make_config

    front = AsyncLLMEngine(engine)
    front.shutdown()
    config = make_config(tmp_path, model="tiny")
    app = create_app(config, engine=front)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4})

    resp = asyncio.run(main())
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["code"] == "engine_unavailable"
    assert resp.headers["retry-after"] == "5"


def test_event_stream_keeps_order_and_wakes_one_waiting_consumer():
    """The per-request channel between the engine thread's hand-off and the consumer: events put before the consumer
    waits and while it waits all arrive, in order; a cancelled wait leaves no waiter behind to be woken."""
    from tailguard.engine.engine import _EventStream

    async def main():
        stream = _EventStream(asyncio.get_running_loop())
        stream.put("a")
        stream.put("b")
        got = [stream.pending.popleft(), stream.pending.popleft()]
        waiting = asyncio.ensure_future(stream.wait())
        await asyncio.sleep(0)
        assert stream.waiter is not None and not waiting.done()
        stream.put("c")
        await asyncio.wait_for(waiting, 1)
        got.append(stream.pending.popleft())
        cancelled = asyncio.ensure_future(stream.wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert stream.waiter is None
        stream.put("d")  # no waiter: kept for the next read
        got.append(stream.pending.popleft())
        return got

    assert asyncio.run(main()) == ["a", "b", "c", "d"]


def test_from_args_loads_and_steps_the_engine_on_one_thread(tiny_gguf):
    """libgomp keeps one pool of OpenMP workers per thread that opens parallel regions: loading on one thread and
    stepping on another left two pools, and more OpenMP threads than cores make libgomp sleep at every barrier
    instead of spinning. ``from_args`` loads the model on the thread that steps it."""
    steps_on: list[int] = []
    built_on: list[int] = []
    real_init = LLMEngine.__init__

    def recording_init(self, args):
        built_on.append(threading.get_ident())
        real_init(self, args)

    LLMEngine.__init__ = recording_init
    try:
        front = AsyncLLMEngine.from_args(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=4096, max_model_len=512,
                                                    num_threads=1))
    finally:
        LLMEngine.__init__ = real_init
    real_step = front.engine.step

    def observed_step():
        steps_on.append(threading.get_ident())
        return real_step()

    front.engine.step = observed_step
    try:
        got, exc = asyncio.run(asyncio.wait_for(_drain(front, "threads", 4), 60))
    finally:
        front.shutdown()
    assert exc is None and got == 4
    assert set(steps_on) == set(built_on) == {front._thread.ident}
    assert built_on[0] != threading.get_ident()


def test_from_args_reports_a_load_failure_on_the_caller_thread():
    with pytest.raises(Exception, match="no-such-model|not found|No such file|unknown"):
        AsyncLLMEngine.from_args(EngineArgs(model="/nonexistent/no-such-model.gguf"))


def test_from_args_calibrates_the_step_cost_model_and_leaves_no_trace(tiny_gguf):
    """Before serving, a few timed steps fit the step-cost model (predicted TTFTs and the time budget start from
    this machine, not the prior); the engine then reports no step, no prefix-cache query and no cached block."""
    from tailguard.engine.step_cost import StepCostModel

    prior = StepCostModel().snapshot()
    front = AsyncLLMEngine.from_args(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=8192, num_threads=1))
    try:
        engine = front.engine
        assert engine.scheduler.cost.observed >= 8 and engine.scheduler.cost.snapshot() != prior
        stats = engine.stats()
        assert (stats.steps, stats.prefix_cache_queries, stats.kv_blocks_cached, stats.kv_blocks_used) == (0, 0, 0, 0)
    finally:
        front.shutdown()
    off = AsyncLLMEngine.from_args(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=8192, num_threads=1,
                                              calibrate=False))
    try:
        assert off.engine.scheduler.cost.observed == 0 and off.engine.scheduler.cost.snapshot() == prior
    finally:
        off.shutdown()
