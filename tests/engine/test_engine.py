"""The engine on a tiny random model: batching, KV accounting, limits, sampling, streaming; and the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import statistics
import time

import pytest

from tailguard.engine.engine import AsyncLLMEngine, TokenEvent
from tailguard.engine.fake import FakeEngine, FakeTiming
from tailguard.engine.sequence import FinishReason, RequestError, SamplingParams
from tests.conftest import churn


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def random_prompts(n: int, seed: int, lo: int = 3, hi: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def collect(engine, prompt: list[int], sampling: SamplingParams) -> tuple[list[TokenEvent], TokenEvent]:
    """Run one request alone to completion; returns its events and the final one."""
    rid = engine.add_request(prompt, sampling)
    events = []
    while engine.has_unfinished():
        events.extend(ev for ev in engine.step() if ev.request_id == rid)
    assert events and events[-1].finished and all(not ev.finished for ev in events[:-1])
    return events, events[-1]


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]


def text_of(events: list[TokenEvent]) -> str:
    return "".join(ev.text for ev in events)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": "Tell me a short story about a robot."}])


@pytest.fixture(scope="module")
def reference(_tiny_engine_session, chat_prompt):
    """Greedy output of the chat prompt, generated alone (20 tokens, no EOS stop)."""
    events, _ = collect(_tiny_engine_session, chat_prompt, greedy(20))
    return tokens_of(events), text_of(events)


def spy_schedule(engine, monkeypatch) -> list[tuple[int, int, int]]:
    """Record (decode chunks, prefill chunks, tokens) of every scheduled step."""
    record: list[tuple[int, int, int]] = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        decodes = sum(c.is_decode for c in out.chunks)
        record.append((decodes, len(out.chunks) - decodes, out.num_tokens))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    return record


# --- batching -----------------------------------------------------------------------------------------------------


def test_batch_invariance_under_chunked_prefill(tiny_engine, monkeypatch):
    prompts = random_prompts(16, seed=1)
    prompts[0] = list(prompts[0][:3])
    prompts[1] = prompts[2][:-1] + [prompts[3][-1]]  # same context but the last token
    sp = greedy(12)
    alone = [tiny_engine.generate([p], sp)[0] for p in prompts]
    assert len({tuple(o) for o in alone}) == 16, "the model should not answer different prompts identically"

    record = spy_schedule(tiny_engine, monkeypatch)
    ids = [tiny_engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts[:10]]
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while tiny_engine.has_unfinished():
        if steps == 4:  # late arrivals prefill while the first ones decode
            for p in prompts[10:]:
                rid = tiny_engine.add_request(p, SamplingParams(**vars(sp)))
                ids.append(rid)
                outputs[rid] = []
        for ev in tiny_engine.step():
            outputs[ev.request_id].append(ev.token_id)
        steps += 1
    batched = [outputs[rid] for rid in ids]
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert a == b, f"prompt {i} (len {len(prompts[i])}): alone {a} vs batched {b}"
    assert tiny_engine.args.max_num_batched_tokens == 64
    # the token budget, or a little past it when that finishes a prompt (SchedulerConfig.prefill_overrun_tokens)
    assert max(n for _, _, n in record) <= 64 + tiny_engine.scheduler.config.max_prefill_overrun
    assert any(d > 0 and p > 0 for d, p, _ in record), "no step mixed decodes with a prefill chunk"
    assert max(d for d, _, _ in record) >= 8, "requests were not decoded together"


def test_preemption_by_recompute_keeps_greedy_output(tiny_engine_f32kv, small_kv_engine):
    prompts = random_prompts(8, seed=2, lo=30, hi=60)
    sp = greedy(40)
    expected = tiny_engine_f32kv.generate(prompts, sp)
    before = small_kv_engine.stats().num_preemptions
    got = small_kv_engine.generate(prompts, sp)
    assert small_kv_engine.stats().num_preemptions > before, "the small KV cache was meant to force preemptions"
    assert got == expected


def test_no_leaked_blocks_after_random_aborts_and_preemptions(small_kv_engine):
    engine = small_kv_engine
    rng = random.Random(3)
    pending = []
    for i in range(200):
        sp = SamplingParams(
            max_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.8]),
            seed=rng.choice([None, i]),
            ignore_eos=True,
        )
        pending.append((f"leak-{i}", [rng.randrange(100, 49000) for _ in range(rng.randint(1, 90))], sp, rng.randint(0, 2)))
    wanted = {rid: sp.max_tokens for rid, _, sp, _ in pending}
    before = engine.stats().num_preemptions
    max_used = 0

    def track() -> None:
        nonlocal max_used
        max_used = max(max_used, engine.pool.num_used)

    final = churn(engine, pending, rng, track)
    assert engine.abort("leak-0") is None, "aborting a finished request is a no-op"
    stats = engine.stats()
    assert stats.num_preemptions > before, "the workload was meant to force preemptions"
    assert max_used == engine.pool.num_blocks, "the workload was meant to fill the KV cache"
    assert len(final) == 200
    aborted = [r for r, ev in final.items() if ev.finish_reason is FinishReason.ABORT]
    print(f"{len(aborted)} aborted, {stats.num_preemptions - before} preemptions")
    assert 5 <= len(aborted) <= 100, f"{len(aborted)} aborted: the mix of aborts and completions is off"
    for rid, ev in final.items():
        if ev.finish_reason is not FinishReason.ABORT:
            assert ev.finish_reason is FinishReason.LENGTH and ev.num_output_tokens == wanted[rid], rid
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
    assert engine.pool.num_used == 0 and engine.pool.owners() == set()


# --- limits -------------------------------------------------------------------------------------------------------


def test_prompt_longer_than_context_window_is_rejected(tiny_engine):
    assert tiny_engine.max_model_len == 512
    for n in (512, 600):
        with pytest.raises(RequestError) as err:
            tiny_engine.add_request([100] * n, greedy(1))
        assert str(n) in str(err.value) and "512" in str(err.value)
    assert not tiny_engine.has_unfinished()


def test_max_tokens_past_context_window_is_rejected(tiny_engine):
    with pytest.raises(RequestError) as err:
        tiny_engine.add_request([100] * 500, greedy(20))
    msg = str(err.value)
    for number in ("500", "20", "520", "512", "12"):
        assert number in msg, f"{number} missing from {msg!r}"
    events, last = collect(tiny_engine, [100] * 500, greedy(12))  # exactly fills the window
    assert last.num_output_tokens == 12 and last.finish_reason is FinishReason.LENGTH


def test_bad_requests_are_rejected(tiny_engine):
    with pytest.raises(RequestError, match="vocabulary"):
        tiny_engine.add_request([5, 10**6], greedy(4))
    with pytest.raises(RequestError):
        tiny_engine.add_request([5, 6], SamplingParams(max_tokens=0))
    with pytest.raises(RequestError):
        tiny_engine.add_request([5, 6], SamplingParams(top_p=0))
    with pytest.raises(RequestError):
        tiny_engine.add_request([5, 6], SamplingParams(max_tokens=4, min_tokens=5))
    with pytest.raises(RequestError):
        tiny_engine.add_request([], greedy(4))
    assert not tiny_engine.has_unfinished()


# --- sampling -----------------------------------------------------------------------------------------------------


def test_same_seed_same_output_even_when_batched(tiny_engine, chat_prompt):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    first = tiny_engine.generate([chat_prompt], sp)[0]
    again = tiny_engine.generate([chat_prompt], sp)[0]
    assert first == again
    # Next to other requests (seeded and not), the seeded request still draws the same tokens.
    others = random_prompts(5, seed=4)
    batch = tiny_engine.generate([*others, chat_prompt], sp)
    assert batch[-1] == first
    other_seed = tiny_engine.generate([chat_prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed != first, "a different seed should draw different tokens"


def test_temperature_zero_top_k_one_and_tiny_top_p_are_greedy(tiny_engine, chat_prompt, reference):
    ref_tokens, _ = reference
    for sp in (
        SamplingParams(max_tokens=20, temperature=1.0, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, top_p=1e-6, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1e-4, ignore_eos=True),
    ):
        assert tiny_engine.generate([chat_prompt], sp)[0] == ref_tokens, sp
    # And greedy is really the argmax: each token is the top alternative of its own distribution.
    events, _ = collect(tiny_engine, chat_prompt, greedy(20, logprobs=1))
    assert tokens_of(events) == ref_tokens
    assert all(ev.top_logprobs[0][0] == ev.token_id for ev in events)


def test_sampling_at_temperature_one_is_not_greedy(tiny_engine, chat_prompt, reference):
    ref_tokens, _ = reference
    outs = tiny_engine.generate([chat_prompt] * 3, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    assert any(o != ref_tokens for o in outs)


@pytest.mark.parametrize("trim", [0, 1], ids=["ends-at-token-boundary", "ends-inside-a-token"])
def test_stop_string_truncates_text_and_finishes_with_stop(tiny_engine, chat_prompt, reference, trim):
    ref_tokens, ref_text = reference
    decode = tiny_engine.tokenizer.decode

    def candidate(i: int) -> str:
        text = decode(ref_tokens[i : i + 2])
        return text[: len(text) - trim]

    # A stop string spanning output tokens i and i+1, found nowhere else in the reference text.
    i, stop = next((i, candidate(i)) for i in range(4, 16) if ref_text.count(candidate(i)) == 1 and len(candidate(i)) > 2)
    cut = ref_text.index(stop)
    events, last = collect(tiny_engine, chat_prompt, greedy(20, stop=[stop]))
    assert last.finish_reason is FinishReason.STOP
    assert text_of(events) == ref_text[:cut]
    assert stop not in text_of(events)
    assert tokens_of(events) == ref_tokens[: i + 2], "it stops as soon as the stop string is complete"
    # The streamed text never shows a prefix of the stop string that is later cut.
    streamed = ""
    for ev in events:
        streamed += ev.text
        assert ref_text.startswith(streamed) and len(streamed) <= cut


def test_stop_string_seen_before_min_tokens_does_not_stop_later(tiny_engine, chat_prompt, reference):
    """min_tokens defers stop checks; an occurrence completed before it must not end the request afterwards."""
    ref_tokens, ref_text = reference
    decode = tiny_engine.tokenizer.decode
    stop = decode(ref_tokens[2:4])
    assert ref_text.count(stop) == 1 and stop in decode(ref_tokens[:4])
    events, last = collect(tiny_engine, chat_prompt, greedy(20, stop=[stop], min_tokens=8))
    assert (last.finish_reason, last.num_output_tokens) == (FinishReason.LENGTH, 20), (
        f"finished with {last.finish_reason} after {last.num_output_tokens} tokens"
    )
    assert text_of(events) == ref_text


def test_stop_token_ids_and_min_tokens(tiny_engine, chat_prompt, reference):
    ref_tokens, _ = reference
    stop_tok = ref_tokens[2]
    assert stop_tok not in ref_tokens[:2]
    events, last = collect(tiny_engine, chat_prompt, greedy(20, stop_token_ids=[stop_tok]))
    assert tokens_of(events) == ref_tokens[:3] and last.finish_reason is FinishReason.STOP
    # min_tokens forbids the stop token until 6 tokens are out.
    events, last = collect(tiny_engine, chat_prompt, greedy(20, stop_token_ids=[stop_tok], min_tokens=6))
    out = tokens_of(events)
    assert len(out) >= 6 and stop_tok not in out[:6]
    assert out[:2] == ref_tokens[:2] and out[2] != stop_tok
    if last.finish_reason is FinishReason.STOP:
        assert out[-1] == stop_tok and stop_tok not in out[:-1]
    else:
        assert last.finish_reason is FinishReason.LENGTH and len(out) == 20


def test_eos_stops_unless_ignored(tiny_engine, chat_prompt, reference, monkeypatch):
    ref_tokens, _ = reference
    eos = ref_tokens[4]  # pretend the model's 5th token is its EOS
    assert eos not in ref_tokens[:4]
    monkeypatch.setattr(tiny_engine, "stop_ids", {eos})
    events, last = collect(tiny_engine, chat_prompt, SamplingParams(max_tokens=20, temperature=0))
    assert tokens_of(events) == ref_tokens[:5] and last.finish_reason is FinishReason.STOP
    events, last = collect(tiny_engine, chat_prompt, greedy(20, ignore_eos=True))
    assert tokens_of(events) == ref_tokens and last.finish_reason is FinishReason.LENGTH
    events, last = collect(tiny_engine, chat_prompt, SamplingParams(max_tokens=20, temperature=0, min_tokens=8))
    out = tokens_of(events)
    assert out[:4] == ref_tokens[:4] and eos not in out[:8] and len(out) >= 8


def test_max_tokens_gives_length(tiny_engine, chat_prompt, reference):
    ref_tokens, ref_text = reference
    events, last = collect(tiny_engine, chat_prompt, greedy(7))
    assert tokens_of(events) == ref_tokens[:7]
    assert last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 7
    assert last.num_prompt_tokens == len(chat_prompt)
    assert ref_text.startswith(text_of(events)) and text_of(events) == tiny_engine.tokenizer.decode(ref_tokens[:7])


def test_logprobs_with_top_alternatives(tiny_engine, chat_prompt):
    events, _ = collect(tiny_engine, chat_prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=5, logprobs=5, ignore_eos=True))
    for ev in events:
        assert ev.logprob is not None and ev.logprob <= 0
        assert len(ev.top_logprobs) == 5
        values = [lp for _, lp in ev.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        assert ev.logprob <= values[0] + 1e-6
        top = dict(ev.top_logprobs)
        if ev.token_id in top:
            assert top[ev.token_id] == pytest.approx(ev.logprob, abs=1e-5)
    events, _ = collect(tiny_engine, chat_prompt, greedy(3))
    assert all(ev.logprob is None and ev.top_logprobs is None for ev in events)
    events, _ = collect(tiny_engine, chat_prompt, greedy(3, logprobs=0))
    assert all(ev.logprob is not None and ev.top_logprobs == [] for ev in events)


# --- abort --------------------------------------------------------------------------------------------------------


def test_abort_frees_blocks(tiny_engine, chat_prompt):
    running = tiny_engine.add_request(chat_prompt, greedy(100))
    for _ in range(3):
        tiny_engine.step()
    assert tiny_engine.pool.num_used > 0 and tiny_engine.pool.owners() == {running}
    event = tiny_engine.abort(running)
    assert event.finished and event.finish_reason is FinishReason.ABORT
    assert event.num_output_tokens >= 1 and event.first_token is not None
    assert tiny_engine.pool.num_used == 0 and not tiny_engine.has_unfinished()
    assert tiny_engine.step() == []
    assert tiny_engine.abort(running) is None
    # A request still waiting can be aborted too.
    waiting = tiny_engine.add_request(chat_prompt, greedy(5))
    event = tiny_engine.abort(waiting)
    assert event.finish_reason is FinishReason.ABORT and event.first_scheduled is None


# --- async front --------------------------------------------------------------------------------------------------


@pytest.fixture
def async_engine(tiny_engine):
    engine = AsyncLLMEngine(tiny_engine)
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()
    assert engine.error is None


async def _wait_until(predicate, timeout: float = 20.0) -> None:
    deadline = time.perf_counter() + timeout
    while not predicate():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_async_stream_timestamps_and_tokens(tiny_engine_f32kv, chat_prompt):
    # A float32 KV cache: the async path steps the prompts as they arrive, the sync one all together, and with a
    # float16 cache the two agree only to half precision (a near-tie turned one greedy token in a full CI run).
    engine = tiny_engine_f32kv
    prompts = [chat_prompt, *random_prompts(3, seed=5)]
    expected = engine.generate(prompts, greedy(12))
    async_engine = AsyncLLMEngine(engine)

    async def consume(prompt, rid):
        return [ev async for ev in async_engine.generate(prompt, greedy(12), rid)]

    async def main():
        return await asyncio.gather(*(consume(p, f"async-{i}") for i, p in enumerate(prompts)))

    try:
        streams = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert async_engine.error is None
    for events, want in zip(streams, expected):
        assert tokens_of(events) == want
        times = [ev.time for ev in events]
        assert times == sorted(times), "token timestamps must be monotonic"
        last = events[-1]
        assert last.finished and last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 12
        assert last.arrival <= last.first_scheduled <= last.first_token <= last.time
        assert last.first_token == events[0].time
        assert text_of(events) == engine.tokenizer.decode(want)


def test_async_rejects_too_long_prompt(async_engine):
    async def main():
        with pytest.raises(RequestError, match="512"):
            async for _ in async_engine.generate([100] * 600, greedy(4), "too-long"):
                pass

    asyncio.run(main())


def test_leaving_the_async_iterator_aborts_the_request(async_engine, tiny_engine, chat_prompt, monkeypatch):
    aborted: dict[str, TokenEvent | None] = {}
    original_abort = tiny_engine.abort

    def abort(request_id):
        aborted[request_id] = event = original_abort(request_id)
        return event

    monkeypatch.setattr(tiny_engine, "abort", abort)
    freed = lambda: tiny_engine.pool.num_used == 0 and not tiny_engine.has_unfinished()  # noqa: E731

    async def main():
        # 1. Plain `break`: the generator is finalized and its cleanup aborts the request.
        received = 0
        async for _ev in async_engine.generate(chat_prompt, greedy(400), "leave-break"):
            received += 1
            if received == 3:
                break
        await _wait_until(lambda: "leave-break" in aborted and freed())
        # 2. Closing it explicitly (what a server does when the client disconnects).
        stream = async_engine.generate(chat_prompt, greedy(400), "leave-close")
        async with contextlib.aclosing(stream):
            async for _ev in stream:
                break
        await _wait_until(lambda: "leave-close" in aborted and freed())

        # 3. Cancelling the task that consumes the stream.
        async def consume():
            async for _ev in async_engine.generate(chat_prompt, greedy(400), "leave-cancel"):
                pass

        task = asyncio.create_task(consume())
        await _wait_until(lambda: tiny_engine.pool.num_used > 0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _wait_until(lambda: "leave-cancel" in aborted and freed())

    asyncio.run(main())
    for rid in ("leave-break", "leave-close", "leave-cancel"):
        event = aborted[rid]
        assert event is not None, f"{rid} had already finished: the abort came too late to prove anything"
        assert event.finish_reason is FinishReason.ABORT and event.num_output_tokens < 400


# --- fake engine --------------------------------------------------------------------------------------------------


async def _timed_stream(engine, prompt, sampling, rid):
    start = time.perf_counter()
    events = [ev async for ev in engine.generate(prompt, sampling, rid)]
    return start, events


def test_fake_engine_honours_scripted_ttft_and_itl():
    fake = FakeEngine(FakeTiming(ttft=0.25, itl=0.05))

    async def main():
        return await _timed_stream(fake, [3] * 10, SamplingParams(max_tokens=6), "fake-1")

    start, events = asyncio.run(main())
    assert len(events) == 6 and events[-1].finish_reason is FinishReason.LENGTH
    ttft = events[0].time - start
    gaps = [b.time - a.time for a, b in zip(events, events[1:])]
    itl = statistics.median(gaps)
    assert ttft >= 0.25 * 0.95 and min(gaps) >= 0.05 * 0.9, "the fake never runs ahead of its script"
    assert 2 <= ttft / itl <= 15, f"ttft {ttft:.3f}s / itl {itl:.3f}s should be about 5"
    last = events[-1]
    assert last.arrival <= last.first_scheduled <= last.first_token <= last.time
    assert text_of(events) == FakeTiming().output_text[:6]


def test_fake_engine_prefill_cost_grows_with_prompt_length():
    fake = FakeEngine(FakeTiming(ttft=0.05, itl=0.01, prefill_per_token=0.001))

    async def main():
        return await asyncio.gather(
            _timed_stream(fake, [3] * 2, SamplingParams(max_tokens=2), "short"),
            _timed_stream(fake, [3] * 300, SamplingParams(max_tokens=2), "long"),
        )

    (s_start, short), (l_start, long) = asyncio.run(main())
    short_ttft, long_ttft = short[0].time - s_start, long[0].time - l_start
    assert long_ttft / short_ttft >= 2.5, f"expected about 6.7x, got {long_ttft:.3f}s vs {short_ttft:.3f}s"


def test_fake_engine_concurrency_slots_queue_requests():
    fake = FakeEngine(FakeTiming(ttft=0.01, itl=0.005, max_num_seqs=1))

    async def main():
        return await asyncio.gather(
            *(_timed_stream(fake, [3] * 4, SamplingParams(max_tokens=3), f"slot-{i}") for i in range(3))
        )

    finals = sorted((events[-1] for _, events in asyncio.run(main())), key=lambda ev: ev.first_scheduled)
    for earlier, later in zip(finals, finals[1:]):
        assert later.first_scheduled >= earlier.time, "a second request ran while the only slot was taken"
    assert fake.running == 0 and fake.waiting == 0 and fake.completed == 3


@pytest.mark.parametrize("stop", [["brown"], ["fox jumps", "lazy"], ["o"], ["not in the text"]])
def test_fake_engine_stop_strings_match_the_real_engine(tiny_engine, monkeypatch, stop):
    """Both engines, fed the same text, cut it at the same place and never stream a stop string's prefix."""
    from tailguard.engine.torch_runner import SampledToken

    text = FakeTiming().output_text
    script = itertools.cycle(tiny_engine.tokenizer.encode(text))  # the fake repeats its text too
    # The real engine's model replaced by a script that produces ``text`` token by token (BPE tokens, where the fake
    # produces bytes): what is compared is the engine's own stop-string and detokenization logic.
    monkeypatch.setattr(tiny_engine.runner, "execute", lambda chunks, tables, stop_ids, probe=None: [
        [SampledToken(next(script))] if c.samples else [] for c in chunks])
    sp = SamplingParams(max_tokens=40, stop=stop)
    tiny_engine.add_request([3, 4, 5], sp, request_id="real-stop")
    real: list[TokenEvent] = []
    while tiny_engine.has_unfinished():
        real.extend(tiny_engine.step())
    fake = FakeEngine(FakeTiming(ttft=0.0, itl=0.0))

    async def main():
        return await _timed_stream(fake, [3], SamplingParams(max_tokens=len(text.encode()), stop=stop), "fake-stop")

    _, events = asyncio.run(main())
    real_text, fake_text = text_of(real), text_of(events)
    if any(s in text for s in stop):
        assert real[-1].finish_reason is events[-1].finish_reason is FinishReason.STOP
        assert fake_text == real_text
    else:  # no stop string: each runs to its own token limit; the texts agree as far as both went
        assert real_text.startswith(fake_text) or fake_text.startswith(real_text)
    for stream in (real, events):
        streamed = ""
        for ev in stream:
            streamed += ev.text
            assert not any(s in streamed for s in stop), f"stop string leaked into {streamed!r}"


def test_fake_engine_streams_multibyte_text_intact():
    text = "你好，世界。"
    fake = FakeEngine(FakeTiming(ttft=0.0, itl=0.0, output_text=text))

    async def main():
        return await _timed_stream(fake, [3], SamplingParams(max_tokens=len(text.encode())), "fake-utf8")

    _, events = asyncio.run(main())
    assert text_of(events) == text
    assert all("\ufffd" not in ev.text for ev in events)


def test_fake_engine_abort_on_leaving_the_stream_and_limits():
    fake = FakeEngine(FakeTiming(ttft=0.0, itl=0.001), max_model_len=100)

    async def main():
        async for _ev in fake.generate([3] * 5, SamplingParams(max_tokens=50), "fake-leave"):
            break
        await asyncio.sleep(0.05)
        with pytest.raises(RequestError, match="100"):
            async for _ in fake.generate([3] * 90, SamplingParams(max_tokens=20), "fake-long"):
                pass

    asyncio.run(main())
    assert fake.aborted == ["fake-leave"] and fake.running == 0
