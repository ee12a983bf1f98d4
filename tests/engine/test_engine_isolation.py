"""A request fails alone: whatever goes wrong with one sequence (its sampling, its stop rules or detokenizing, its
drafts, the model run of its step) ends that request with an error, and the engine goes on serving every other."""

from __future__ import annotations

import asyncio

import pytest

from tailguard.engine.engine import AsyncLLMEngine, EngineArgs, LLMEngine
from tailguard.engine.sampling import Sampler
from tailguard.engine.sequence import FinishReason, SamplingParams, SequenceFailed

PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.fixture
def engine(tiny_gguf):
    return LLMEngine(EngineArgs(model=str(tiny_gguf), kv_cache_tokens=4096, max_model_len=512, num_threads=1))


def sampled(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, ignore_eos=True, **kw)


def run_all(engine: LLMEngine) -> dict[str, list]:
    """Step until nothing is left; every request's events by id."""
    events: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    assert not engine.has_unfinished()
    return events


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64 - 1, 2**63])
def test_any_64_bit_seed_samples_and_repeats(engine, seed):
    engine.add_request(PROMPT, sampled(6, seed=seed), "a")
    engine.add_request(PROMPT, sampled(6, seed=seed), "b")
    events = run_all(engine)
    tokens = {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}
    assert len(tokens["a"]) == 6 and tokens["a"] == tokens["b"]
    assert all(evs[-1].finish_reason is FinishReason.LENGTH for evs in events.values())


def test_a_tiny_temperature_is_greedy_not_nan(engine):
    engine.add_request(PROMPT, SamplingParams(max_tokens=5, temperature=1e-300, ignore_eos=True), "tiny-t")
    engine.add_request(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "greedy")
    events = run_all(engine)
    out = {rid: [e.token_id for e in evs if e.token_id is not None] for rid, evs in events.items()}
    assert out["tiny-t"] == out["greedy"]


def test_a_sampling_failure_ends_that_request_alone(engine, monkeypatch):
    real = Sampler._sample_row

    def broken_for_one(self, row, seq, stop_ids):
        if seq.request_id == "bad" and len(seq.output_token_ids) == 2:
            raise ValueError("injected sampling failure")
        return real(self, row, seq, stop_ids)

    monkeypatch.setattr(Sampler, "_sample_row", broken_for_one)
    for rid in ("left", "bad", "right"):
        engine.add_request(PROMPT, sampled(8, seed=7), rid)
    events = run_all(engine)
    bad = events["bad"][-1]
    assert bad.finished and bad.finish_reason is FinishReason.ERROR and bad.request_failed
    assert "injected sampling failure" in (bad.error or "")
    for rid in ("left", "right"):  # its neighbours in the very same steps lose nothing
        assert events[rid][-1].finish_reason is FinishReason.LENGTH
        assert sum(e.token_id is not None for e in events[rid]) == 8
    assert engine.pool.num_used == engine.pool.num_cached  # the failed request's blocks went back


def test_a_post_processing_failure_ends_that_request_alone(engine, monkeypatch):
    engine.add_request(PROMPT, sampled(6), "ok")
    engine.add_request(PROMPT, sampled(6), "bad")
    tracked = engine._tracked["bad"]

    def broken_add(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")

    monkeypatch.setattr(tracked.detok, "add", broken_add)
    events = run_all(engine)
    assert events["bad"][-1].request_failed and "injected detokenizer failure" in events["bad"][-1].error
    assert events["ok"][-1].finish_reason is FinishReason.LENGTH


def test_a_failed_model_run_ends_its_step_and_the_engine_goes_on(engine, monkeypatch):
    engine.add_request(PROMPT, sampled(4), "in-the-step")
    real = engine.runner.execute
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", broken_once)
    events = run_all(engine)
    final = events["in-the-step"][-1]
    assert final.request_failed and "injected kernel failure" in final.error
    engine.add_request(PROMPT, sampled(4), "after")  # the engine still serves
    after = run_all(engine)["after"]
    assert after[-1].finish_reason is FinishReason.LENGTH and sum(e.token_id is not None for e in after) == 4
    assert engine.pool.num_used == engine.pool.num_cached


def test_the_async_front_raises_sequence_failed_for_that_request_only(engine, monkeypatch):
    real = Sampler._sample_row

    def broken_for_one(self, row, seq, stop_ids):
        if seq.request_id == "bad":
            raise ValueError("injected")
        return real(self, row, seq, stop_ids)

    monkeypatch.setattr(Sampler, "_sample_row", broken_for_one)
    front = AsyncLLMEngine(engine)

    async def drain(rid: str) -> tuple[int, BaseException | None]:
        got = 0
        try:
            async for ev in front.generate(PROMPT, sampled(10), rid):
                got += ev.token_id is not None
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            return got, exc
        return got, None

    async def main():
        return await asyncio.wait_for(asyncio.gather(drain("good-1"), drain("bad"), drain("good-2")), 30)

    results = asyncio.run(main())
    assert results[0] == (10, None) and results[2] == (10, None)
    assert isinstance(results[1][1], SequenceFailed)
    assert front.is_running and front.error is None
    front.shutdown()
