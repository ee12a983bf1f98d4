"""Model-based proposers (drafting.py): a draft model with its own KV cache, and the self-draft over the target's.

The draft model here is the tiny target itself: its guesses are then nearly always right, so every step verifies a
full proposal and the draft's bookkeeping (catching up on the prompt and on the target's bonus tokens, forgetting
rejected guesses, a preempted sequence's new blocks) decides whether the acceptance stays high. The output must be
token for token the reference in every case: the verification guarantees it whatever the draft guesses.
"""

from __future__ import annotations

import random

import pytest

from tailguard.engine.drafting import DraftProposer, self_draft_layers
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.model_store import ModelNotFoundError
from tailguard.engine.sequence import FinishReason, SamplingParams
from tests.conftest import _assert_clean, _make_engine, churn
from tests.engine.test_speculative import TEXT_PROMPTS, greedy, repetitive_prompts, run_all, tokens_of


@pytest.fixture(scope="module")
def draft_engine(tiny_gguf):
    return _make_engine(tiny_gguf, kv_cache_dtype="float32", speculative=f"draft:{tiny_gguf}",
                        speculative_max_running=32)


@pytest.fixture(scope="module")
def self_engine(tiny_gguf):
    return _make_engine(tiny_gguf, kv_cache_dtype="float32", speculative="self", speculative_max_running=32)


@pytest.fixture(scope="module")
def text_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in TEXT_PROMPTS]


def acceptance(engine: LLMEngine, before) -> tuple[int, int]:
    stats = engine.stats()
    return stats.num_spec_proposed - before.num_spec_proposed, stats.num_spec_accepted - before.num_spec_accepted


def test_draft_model_greedy_identical_and_accepts_what_the_target_would_say(draft_engine, tiny_engine_f32kv,
                                                                            text_prompts):
    _assert_clean(draft_engine)
    before = draft_engine.stats()
    for i, prompt in enumerate(text_prompts):
        sp = greedy(60)
        expected = tiny_engine_f32kv.generate([prompt], sp)[0]
        [events] = run_all(draft_engine, [(prompt, sp)])
        assert tokens_of(events) == expected, f"prompt {i} diverged"
    proposed, accepted = acceptance(draft_engine, before)
    print(f"draft model: proposed {proposed}, accepted {accepted}")
    # A draft identical to the target can only miss where two logits tie within float error.
    assert proposed > 500 and accepted >= 0.95 * proposed
    _assert_clean(draft_engine)
    assert draft_engine.speculation.proposer._seen == {}, "per-request draft state leaked"


@pytest.mark.parametrize("which", ["draft", "self"])
def test_model_drafts_in_a_16_stream_batch_with_opt_outs_and_poisoned_rollbacks(request, which, tiny_engine_f32kv,
                                                                                text_prompts, monkeypatch):
    """Rolled-back positions are overwritten with huge values in both caches (the target's and the draft's): a draft
    that read a stale guess's K/V would then guess wrong and the acceptance would collapse; a target that read one
    would change the output."""
    draft_engine = request.getfixturevalue(f"{which}_engine")
    _assert_clean(draft_engine)
    monkeypatch.setattr(draft_engine.speculation, "PAUSE_ACCEPTANCE", -1.0)  # keep guessing however few are right
    prompts = text_prompts[:10] + repetitive_prompts(6, seed=21)
    rng = random.Random(8)
    requests = [(p, greedy(rng.randint(30, 80), speculative=(i % 4 != 0))) for i, p in enumerate(prompts)]
    expected = [tiny_engine_f32kv.generate([p], sp)[0] for p, sp in requests]
    caches = [draft_engine.runner.kv_cache]
    if which == "draft":
        caches.append(draft_engine.speculation.proposer.runner.kv_cache)
    flats = [c.view(c.shape[0], 2, -1, *c.shape[-2:]) for c in caches]
    original = draft_engine.scheduler.roll_back

    def poisoning_roll_back(seq, num_accepted):
        table = draft_engine.scheduler.tables[seq.request_id]
        slots = [table.slot(p) for p in range(seq.num_computed_tokens + num_accepted, table.capacity)]
        for flat in flats:
            flat[:, :, slots] = 1e4
        return original(seq, num_accepted)

    monkeypatch.setattr(draft_engine.scheduler, "roll_back", poisoning_roll_back)
    before = draft_engine.stats()
    results = run_all(draft_engine, requests)
    for i, (events, want) in enumerate(zip(results, expected)):
        assert tokens_of(events) == want, f"stream {i} diverged"
        if not requests[i][1].speculative:
            assert events[-1].num_spec_proposed == 0
    proposed, accepted = acceptance(draft_engine, before)
    print(f"batch: proposed {proposed}, accepted {accepted}")
    assert proposed > 300
    if which == "draft":  # the target drafting for itself: guesses are right unless a stale K/V was read
        assert accepted >= 0.9 * proposed
    _assert_clean(draft_engine)


def test_self_draft_is_exact_and_its_guesses_are_verified(self_engine, tiny_engine_f32kv, text_prompts, monkeypatch):
    _assert_clean(self_engine)
    policy = self_engine.speculation
    assert isinstance(policy.proposer, DraftProposer) and policy.proposer.shares_target_kv
    draft_model = policy.proposer.runner.model
    assert len(draft_model.layers) == self_draft_layers(len(self_engine.model.layers)) < len(self_engine.model.layers)
    # The draft's cache is the target's own first layers, not a copy.
    assert policy.proposer.runner.kv_cache.data_ptr() == self_engine.runner.kv_cache.data_ptr()
    monkeypatch.setattr(policy, "PAUSE_ACCEPTANCE", -1.0)  # keep guessing however few are accepted
    before = self_engine.stats()
    for i, prompt in enumerate(text_prompts + repetitive_prompts(4, seed=5)):
        expected = tiny_engine_f32kv.generate([prompt], greedy(40))[0]
        [events] = run_all(self_engine, [(prompt, greedy(40))])
        assert tokens_of(events) == expected, f"prompt {i} diverged"
    proposed, _ = acceptance(self_engine, before)
    assert proposed > 200
    _assert_clean(self_engine)


def test_no_leaks_after_200_requests_with_a_draft_model_under_preemption_aborts_and_sampling(tiny_gguf):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=384, max_num_seqs=16, kv_cache_dtype="float32",
                          speculative=f"draft:{tiny_gguf}", speculative_max_running=16)
    rng = random.Random(4)
    prompts = [p[:90] for p in repetitive_prompts(200, seed=52)]
    pending = [(f"d-{i}", p, SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8]),
                                            seed=i, ignore_eos=True), rng.randint(0, 2))
               for i, p in enumerate(prompts)]
    final = churn(engine, pending, rng, lambda: _blocks_accounted(engine))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_spec_accepted > 50
    assert len(final) == 200
    assert all(ev.finish_reason in (FinishReason.LENGTH, FinishReason.ABORT) for ev in final.values())
    _assert_clean(engine)
    assert engine.speculation.states == {} and engine.speculation.proposer._seen == {}


def _blocks_accounted(engine: LLMEngine) -> None:
    assert engine.pool.num_used == sum(len(t.blocks) for t in engine.scheduler.tables.values())


def test_bad_draft_models_are_refused_before_serving(tiny_gguf, tmp_path):
    with pytest.raises(ModelNotFoundError):
        LLMEngine(EngineArgs(model=str(tiny_gguf), speculative=f"draft:{tmp_path / 'missing.gguf'}",
                             kv_cache_tokens=256))
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLMEngine(EngineArgs(model=str(tiny_gguf), speculative="draft:", kv_cache_tokens=256))


def test_self_draft_head_keeps_whole_row_groups_of_an_interleaved_head(self_engine):
    """A head stored in 16-row groups (Q4_1X / Q8_0X, the int8-activation layouts) is cut at a whole group; any other
    head is cut at the row asked for."""
    from tailguard.engine.drafting import _head_rows
    from tailguard.engine.kernels import GROUP_ROWS, INTERLEAVED_FORMATS

    head = self_engine.runner.model.lm_head
    cut = _head_rows(head, 1000)
    interleaved = head.packed is not None and head.packed.fmt in INTERLEAVED_FORMATS
    assert cut.out_features == (1000 - 1000 % GROUP_ROWS if interleaved else 1000)
    if head.packed is not None:
        assert cut.packed.out_features == cut.out_features
