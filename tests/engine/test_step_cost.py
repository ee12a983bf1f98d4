"""The step cost model (recursive least squares on a step's shape) and the scheduler's step budget in time: while
streams decode, prefill chunks are sized to keep each step within the budget; with none decoding, prefill takes the
whole token budget."""

from __future__ import annotations

import random

import pytest

from tailguard.engine.blocks import BlockPool
from tailguard.engine.scheduler import Scheduler, SchedulerConfig
from tailguard.engine.step_cost import FEATURES, StepCostModel, StepShape, chunk_keys
from tests.engine.test_scheduler import FAKE_TOKEN, FakeClock, make_seq

TRUE = {"fixed": 3e-3, "decode_rows": 4e-4, "decode_kilokeys": 2e-4, "prefill_tokens": 8e-4,
        "prefill_kilokeys": 3e-5}


def true_time(shape: StepShape) -> float:
    return sum(TRUE[name] * x for name, x in zip(FEATURES, shape.features()))


def random_shape(rng: random.Random) -> StepShape:
    rows = rng.randint(0, 32)
    tokens = rng.choice([0, 0, rng.randint(1, 512)])
    start = rng.randint(0, 2000)
    return StepShape(rows, rows * rng.randint(10, 3000), tokens, chunk_keys(start, tokens))


def test_the_model_learns_a_machines_costs_from_timed_steps():
    rng = random.Random(0)
    model = StepCostModel()  # its prior is off by 25-200%
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, true_time(shape) * rng.uniform(0.95, 1.05))  # 5% timing noise
    for _ in range(50):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(true_time(shape), rel=0.1)


def test_the_model_follows_a_machine_that_slows_down():
    rng = random.Random(1)
    model = StepCostModel()
    for i in range(600):
        shape = random_shape(rng)
        slowdown = 1.0 if i < 300 else 2.0  # a neighbour takes half the cores
        model.observe(shape, true_time(shape) * slowdown)
    shape = StepShape(8, 8000, 256, chunk_keys(0, 256))
    assert model.predict(shape) == pytest.approx(2 * true_time(shape), rel=0.1)


def test_serving_shaped_steps_do_not_wind_the_model_up():
    """Serving's steps: long stretches of decode-only steps whose rows and keys grow together (collinear counts),
    a prompt chunk now and then. Every prediction along the way stays near the truth; recursive least squares with
    forgetting once predicted a 15 ms decode step at over 100 ms here, and the time budget then starved prompts."""
    rng = random.Random(3)
    model = StepCostModel()
    worst = 0.0
    rows, ctx = 1, 200
    for step in range(3000):
        if step % 40 == 0:
            rows = rng.randint(1, 30)
        ctx = 200 + step % 300
        prompt = rng.randint(16, 256) if step % 25 == 0 else 0
        shape = StepShape(rows, rows * ctx, prompt, chunk_keys(0, prompt))
        if step > 200:
            probe = StepShape(rows, rows * ctx, 128, chunk_keys(0, 128))
            for s in (shape, probe):
                worst = max(worst, abs(model.predict(s) / true_time(s) - 1))
        model.observe(shape, true_time(shape) * rng.uniform(0.9, 1.1))
    assert worst < 0.3, f"a prediction was off by {worst:.0%}"


def test_prefill_room_is_the_largest_chunk_within_the_budget():
    model = StepCostModel(prior=TRUE)
    base = StepShape(16, 16 * 500)
    for start in (0, 1000):
        room = model.prefill_room(base, 0.1, start, 4096)
        fits = StepShape(16, 16 * 500, room, chunk_keys(start, room))
        over = StepShape(16, 16 * 500, room + 1, chunk_keys(start, room + 1))
        assert 0 < room < 4096
        assert model.predict(fits) <= 0.1 < model.predict(over)
    assert model.prefill_room(base, model.predict(base) / 2, 0, 4096) == 0  # the decodes alone pass it
    assert model.prefill_room(StepShape(), 10.0, 0, 300) == 300  # capped by the chunk asked for


def run_steps(sched: Scheduler, steps: int) -> list:
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        sched.advance(out)
        for c in out.chunks:
            if c.samples:
                c.seq.output_token_ids.append(FAKE_TOKEN)
        outs.append(out)
    return outs


def make_timed(budget_s: float | None) -> Scheduler:
    # the fake clock moves a second a call: the prompt-wait guard kept out of these tests
    sched = Scheduler(SchedulerConfig(max_model_len=8192, max_num_batched_tokens=2048, max_prefill_chunk=2048,
                                      step_time_budget_s=budget_s, min_prefill_chunk=16, prompt_wait_guard_s=1e12),
                      BlockPool(1024, 16), clock=FakeClock())
    sched.cost = StepCostModel(prior=TRUE)
    return sched


@pytest.mark.parametrize("budget_s", [0.02, 0.05])
def test_with_streams_decoding_each_step_stays_within_the_time_budget(budget_s):
    sched = make_timed(budget_s)
    for i in range(8):  # eight streams, already decoding
        sched.add(make_seq(f"s{i}", 32, max_tokens=1000))
    run_steps(sched, 2)
    long = make_seq("long", 3000, max_tokens=4)
    sched.add(long)
    outs = []
    while long.num_computed_tokens < 3000:
        outs += run_steps(sched, 1)
        assert len(outs) < 1000
    prefills = [sum(c.num_tokens for c in o.chunks if c.seq is long) for o in outs]
    assert all(sched.cost.predict(o.shape) <= budget_s for o in outs)
    assert all(o.shape.decode_rows == 8 for o in outs)  # no stream missed a step
    assert 0 < max(prefills) < 2048  # the prompt went on in chunks the budget allowed, not the token budget's
    # Each chunk as large as the budget allowed: the steps used most of it.
    assert sorted(sched.cost.predict(o.shape) for o in outs)[len(outs) // 2] > 0.9 * budget_s


def test_without_a_time_budget_or_without_decodes_prefill_takes_the_token_budget():
    for sched, streams in ((make_timed(None), 8), (make_timed(0.02), 0)):
        for i in range(streams):
            sched.add(make_seq(f"s{i}", 32, max_tokens=1000))
        run_steps(sched, 2)
        sched.add(make_seq("long", 3000, max_tokens=4))
        out = run_steps(sched, 1)[0]
        assert out.shape.prefill_tokens == 2048 - streams


def test_prompts_still_progress_when_the_decodes_alone_pass_the_budget():
    sched = make_timed(0.004)  # 8 decodes cost ~0.006 s: no room at all
    for i in range(8):
        sched.add(make_seq(f"s{i}", 32, max_tokens=1000))
    run_steps(sched, 2)
    sched.add(make_seq("long", 100, max_tokens=4))
    outs = run_steps(sched, 3)
    assert [o.shape.prefill_tokens for o in outs] == [16, 16, 16]


def test_short_prompts_pass_long_ones_that_arrived_within_their_handicap():
    sched = Scheduler(SchedulerConfig(max_model_len=8192, max_num_batched_tokens=256, max_prefill_chunk=256,
                                      prompt_rank_s_per_token=0.001), BlockPool(1024, 16), clock=FakeClock())
    sched.add(make_seq("long", 2000, arrival=10.0))  # ranks as if it arrived at 12.0
    sched.add(make_seq("short-soon", 100, arrival=10.5))  # 10.6: ahead of it
    sched.add(make_seq("short-late", 100, arrival=12.5))  # 12.6: behind it
    sched.add(make_seq("vip-late", 100, priority=-1, arrival=13.0))  # a more important class goes first anyway
    order = []
    for _ in range(40):
        out = sched.schedule()
        sched.advance(out)
        for c in out.chunks:
            if c.seq.request_id not in order:
                order.append(c.seq.request_id)
            if c.samples:
                c.seq.output_token_ids.append(FAKE_TOKEN)
    assert order == ["vip-late", "short-soon", "long", "short-late"]


def test_without_a_handicap_the_order_is_first_come_first_served():
    sched = Scheduler(SchedulerConfig(max_model_len=8192, max_num_batched_tokens=256, max_prefill_chunk=256),
                      BlockPool(1024, 16), clock=FakeClock())
    sched.add(make_seq("long", 2000, arrival=10.0))
    sched.add(make_seq("short", 100, arrival=10.5))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["long"]


def test_the_time_budget_and_the_prompt_rank_are_command_line_options():
    import argparse

    from tailguard.engine_options import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_args_from(parser.parse_args([]))
    assert default.step_time_budget_s == "auto" and default.prompt_rank_s_per_token == 0.0
    assert engine_args_from(parser.parse_args(["--step-time-budget", "auto"])).step_time_budget_s == "auto"
    args = engine_args_from(parser.parse_args(["--step-time-budget", "0.05", "--prompt-rank", "0.002"]))
    assert args.step_time_budget_s == 0.05 and args.prompt_rank_s_per_token == 0.002
    assert engine_args_from(parser.parse_args(["--step-time-budget", "off"])).step_time_budget_s is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--step-time-budget", "0"])


def _engine_costing(tiny_gguf, seconds_per_prompt_token: float, budget):
    """A tiny engine whose step-cost model says a prompt token costs this much (as a calibration would have found)."""
    from tests.conftest import _make_engine

    engine = _make_engine(tiny_gguf, step_time_budget_s=budget)
    engine.scheduler.cost.theta = [2e-3, 5e-4, 1e-4, seconds_per_prompt_token, 1e-5]
    engine.scheduler.cost.observed = 8
    return engine


def test_auto_sets_a_time_budget_where_a_prompt_chunks_step_would_stall_the_streams(tiny_gguf):
    from tailguard.engine.engine import AUTO_PROMPT_WAIT_GUARD_S, AUTO_STEP_TIME_BUDGET_S

    # the tiny engine's prompt chunk is 48 tokens: at 10 ms each its step takes ~0.5 s, as a 512-token chunk's does
    # on a CPU without matrix units
    slow = _engine_costing(tiny_gguf, 1e-2, "auto")
    assert slow.scheduler.config.step_time_budget_s is None  # nothing decided before the calibration
    line = slow.resolve_step_time_budget()
    assert slow.scheduler.config.step_time_budget_s == AUTO_STEP_TIME_BUDGET_S
    assert slow.scheduler.config.prompt_wait_guard_s == AUTO_PROMPT_WAIT_GUARD_S
    assert line.startswith(f"step time budget {AUTO_STEP_TIME_BUDGET_S * 1e3:.0f} ms")
    # what the budget then does: while streams decode, a long prompt's chunks keep each step within it
    chunk = min(slow.scheduler.config.max_num_batched_tokens, slow.scheduler.config.max_prefill_chunk)
    full = slow.scheduler.cost.predict(StepShape(decode_rows=1, decode_keys=64, prefill_tokens=chunk,
                                                 prefill_keys=chunk_keys(0, chunk)))
    assert full > AUTO_STEP_TIME_BUDGET_S  # else the budget would not bind on the tiny engine's chunk


def test_auto_leaves_the_token_budget_alone_where_a_prompt_chunks_step_is_short(tiny_gguf):
    fast = _engine_costing(tiny_gguf, 1e-5, "auto")
    line = fast.resolve_step_time_budget()
    assert fast.scheduler.config.step_time_budget_s is None
    assert line.startswith("no step time budget")


def test_auto_decides_nothing_without_a_timed_step(tiny_gguf):
    uncalibrated = _engine_costing(tiny_gguf, 1e-2, "auto")
    uncalibrated.scheduler.cost.observed = 0  # the generic prior alone: a slow machine's figures, but not measured
    assert uncalibrated.resolve_step_time_budget().startswith("no step time budget")
    assert uncalibrated.scheduler.config.step_time_budget_s is None


def test_a_budget_set_by_hand_is_kept_and_a_wrong_one_refused(tiny_gguf):
    from tailguard.engine.engine import check_step_time_budget

    for budget in (0.05, None):
        engine = _engine_costing(tiny_gguf, 1e-2, budget)
        assert engine.resolve_step_time_budget() is None
        assert engine.scheduler.config.step_time_budget_s == budget
    for wrong in ("fast", 0, -0.1):
        with pytest.raises(ValueError, match="step_time_budget_s"):
            check_step_time_budget(wrong)


class ManualClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _budgeted_with_streams(clock: ManualClock) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_model_len=8192, max_num_batched_tokens=2048, max_prefill_chunk=2048,
                                      step_time_budget_s=0.02, prompt_wait_guard_s=0.5),
                      BlockPool(1024, 16), clock=clock)
    sched.cost = StepCostModel(prior=TRUE)
    for i in range(8):
        sched.add(make_seq(f"s{i}", 32, max_tokens=1000, arrival=clock.t))
    run_steps(sched, 2)
    return sched


def tokens_of_in(sched: Scheduler, seq) -> int:
    return sum(c.num_tokens for c in run_steps(sched, 1)[0].chunks if c.seq is seq)


def test_a_prompt_queue_lifts_the_time_budget_until_it_drains():
    """With streams decoding, a prompt goes in chunks the budget allows; once a prompt has waited longer than the
    guard without a chunk, prefill takes the whole token budget."""
    clock = ManualClock()
    sched = _budgeted_with_streams(clock)
    long = make_seq("long", 3000, max_tokens=4, arrival=clock.t)
    sched.add(long)
    first = tokens_of_in(sched, long)
    assert 0 < first < 2048  # within the guard: the budget's chunk
    queued = make_seq("queued", 600, max_tokens=4, arrival=clock.t)
    sched.add(queued)  # no room left in the budgeted steps: it waits behind the long prompt's chunks
    assert tokens_of_in(sched, queued) == 0
    clock.t += 0.6  # it has waited past the guard
    assert tokens_of_in(sched, long) == 2048 - 8  # prefill takes the token budget, less the decodes (first come first)


def test_one_long_prompt_whose_prefill_progresses_keeps_the_time_budget():
    """A prompt part-way through its prefill, getting a chunk every step, is no queue: however long ago it arrived,
    the streams keep their budgeted steps (one request's prompt must not stall every stream)."""
    clock = ManualClock()
    sched = _budgeted_with_streams(clock)
    long = make_seq("long", 6000, max_tokens=4, arrival=clock.t)
    sched.add(long)
    chunks = []
    for _ in range(6):
        chunks.append(tokens_of_in(sched, long))
        clock.t += 0.3  # slow steps: 1.8 s in all, past the 0.5 s guard since it arrived
    assert all(0 < n < 2048 - 8 for n in chunks), chunks
    assert long.num_computed_tokens < long.num_prompt_tokens  # still part-way


def test_slow_steps_do_not_make_a_progressing_long_prompt_look_stalled():
    """Its progress counts at each step's end: steps slower than the guard (a long context on a slow CPU) must not
    lift the budget, which would make the next steps slower still."""
    clock = ManualClock()
    sched = _budgeted_with_streams(clock)
    long = make_seq("long", 6000, max_tokens=4, arrival=clock.t)
    sched.add(long)
    for _ in range(4):
        out = sched.schedule()
        clock.t += 0.8  # the step takes longer than the 0.5 s guard
        sched.advance(out)
        for c in out.chunks:
            if c.samples:
                c.seq.output_token_ids.append(FAKE_TOKEN)
        n = sum(c.num_tokens for c in out.chunks if c.seq is long)
        assert 0 < n < 2048 - 8, n


def test_a_prompt_past_the_guard_that_one_full_chunk_finishes_gets_it():
    """Part-way through its prefill, a prompt whose rest fits one chunk still counts from its arrival: past the guard,
    one lifted step ends its TTFT (what a queue of the trace's short prompts needs)."""
    clock = ManualClock()
    sched = _budgeted_with_streams(clock)
    mid = make_seq("mid", 1500, max_tokens=4, arrival=clock.t)
    sched.add(mid)
    first = tokens_of_in(sched, mid)
    assert 0 < first < mid.num_pending_tokens
    clock.t += 0.6
    rest = mid.num_pending_tokens
    assert rest > 1000 and tokens_of_in(sched, mid) == rest  # the rest, in one step


# --- predicted TTFT ---------------------------------------------------------------------------------------------------


def predicting(**config) -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_model_len=8192, **config), BlockPool(1024, 16), clock=FakeClock())
    sched.cost = StepCostModel(prior=TRUE)  # never observed: its predictions are the prior's, exactly
    return sched


def test_predicted_ttft_of_a_prompt_alone_is_its_chunks_steps():
    sched = predicting(max_num_batched_tokens=512, max_prefill_chunk=512)
    want = sched.cost.predict(StepShape(0, 0, 512, chunk_keys(0, 512))) + \
        sched.cost.predict(StepShape(0, 0, 88, chunk_keys(512, 88)))
    assert sched.predict_ttft(600) == pytest.approx(want, rel=1e-6)
    assert sched.predict_ttft(100) < sched.predict_ttft(600) < sched.predict_ttft(1200)


def test_predicted_ttft_counts_the_prompts_ranked_ahead_and_the_decoding_streams():
    sched = predicting(max_num_batched_tokens=512, max_prefill_chunk=512, enable_prefix_caching=False)
    alone = sched.predict_ttft(200, priority=1)
    sched.add(make_seq("ahead", 900, priority=1))  # the same priority: it goes first
    sched.add(make_seq("behind", 900, priority=2))  # less important: it does not
    queued = sched.predict_ttft(200, priority=1)
    assert queued > alone

    def steps(*prompts: int) -> float:
        """The prompts' tokens in 512-token steps, each step's keys its share of the prompts' own keys."""
        total, keys = sum(prompts), sum(chunk_keys(0, n) for n in prompts)
        sizes = [512] * (total // 512) + ([total % 512] if total % 512 else [])
        return sum(sched.cost.predict(StepShape(0, 0, n, round(keys * n / total))) for n in sizes)

    assert queued == pytest.approx(steps(900, 200))
    # Two prompts attend to fewer keys than one prompt of both their lengths.
    assert queued < predicting(max_num_batched_tokens=512, max_prefill_chunk=512).predict_ttft(1100)
    # A more important request is behind neither.
    assert sched.predict_ttft(200, priority=0) == pytest.approx(alone)
    # Prompts submitted but not yet taken in by the engine thread count as queued ahead.
    assert sched.predict_ttft(200, priority=1, queued_ahead=[300]) == pytest.approx(steps(900, 300, 200))
    # Streams decoding beside the prompts take rows of every step and lengthen it; the step in progress counts half.
    busy = predicting(max_num_batched_tokens=512, max_prefill_chunk=512, enable_prefix_caching=False)
    for i in range(8):
        busy.add(make_seq(f"s{i}", 32, max_tokens=1000))
    run_steps(busy, 2)
    busy.schedule()  # a decode step in progress
    assert busy.step_shape is not None and busy.step_shape.decode_rows == 8
    rows = StepShape(8, sum(s.num_tokens for s in busy.running), 200, chunk_keys(0, 200))
    assert busy.predict_ttft(200) == pytest.approx(busy.cost.predict(rows) + 0.5 * busy.cost.predict(busy.step_shape))


def test_predicted_ttft_does_not_count_the_prompt_chunk_of_the_step_in_progress_twice():
    """While a step computes a prompt's chunk (scheduled, not yet advanced), those tokens are in the step's half that
    is left, not also in the queue ahead."""
    sched = predicting(max_num_batched_tokens=512, max_prefill_chunk=512, enable_prefix_caching=False)
    sched.add(make_seq("long", 900))
    step = sched.schedule()  # in progress: 512 of its 900 tokens
    assert sched.step_shape is not None and sched.step_shape.prefill_tokens == 512
    rest, mine = chunk_keys(512, 388), chunk_keys(0, 200)
    per_key = (rest + mine) / 588
    want = 0.5 * sched.cost.predict(sched.step_shape) + \
        sched.cost.predict(StepShape(0, 0, 512, round(per_key * 512))) + \
        sched.cost.predict(StepShape(0, 0, 76, round(per_key * 76)))
    assert sched.predict_ttft(200) == pytest.approx(want)
    sched.advance(step)  # done: the same 388 tokens are what the queue holds, and no step runs until the next
    after = sched.cost.predict(StepShape(0, 0, 512, round(per_key * 512))) + \
        sched.cost.predict(StepShape(0, 0, 76, round(per_key * 76)))
    assert sched.predict_ttft(200) == pytest.approx(after)
