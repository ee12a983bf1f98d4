"""Speculative decoding: exact greedy output, the target's distribution when sampling, stop rules, KV rollback, policy."""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest
import torch

from tailguard.engine.engine import EngineArgs, LLMEngine, TokenEvent
from tailguard.engine.scheduler import ScheduledChunk
from tailguard.engine.sequence import FinishReason, SamplingParams
from tailguard.engine.speculative import NgramProposer, SpeculationPolicy, make_proposer
from tests.conftest import _assert_clean, _make_engine, churn

TEXT_PROMPTS = [
    # formatted / repetitive, English
    'Extract name, email and city as JSON from: "Hi, I am Maria Lopez (maria@example.com) from Seattle."',
    "Repeat this text and fix the spelling: The quick brown fox jumpd over the lazy dog. Tehn it ran away.",
    "Rename the variable x to count in this code:\ndef f(x):\n    x = x + 1\n    return x * x",
    "List the days of the week, one per line, as '- Monday'.",
    "Write a markdown table with columns id, name, price for three fruits.",
    'Convert to YAML: {"server": {"host": "localhost", "port": 8080, "debug": true}}',
    "Count from 1 to 20 separated by commas.",
    "Fill in the template for Alice, Bob and Carol: 'Dear NAME, your order is ready.'",
    # free text, English
    "Tell me a short story about a robot.",
    "Why is the sky blue?",
    "What should I cook tonight?",
    "Explain recursion to a child.",
    # formatted, Chinese
    '把下面的信息提取成JSON：张伟，电话13800138000，住在北京市海淀区。',
    "请重复下面这段话并改正错别字：今天天气很好，我们一起去公圆散步吧。",
    "用列表写出中国的四个直辖市，每行一个。",
    "把这段代码里的变量名a改成total：a = 0\nfor i in range(10):\n    a += i",
    # free text, Chinese
    "给我讲一个关于月亮的故事。",
    "为什么猫喜欢睡觉？",
    "介绍一下长城的历史。",
    "今天我应该学习什么？",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random token runs repeated: the n-gram proposer finds matches in the prompt itself."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(100, 49000) for _ in range(rng.randint(4, 24))]
        out.append(base * rng.randint(2, 4) + base[: rng.randint(0, len(base))])
    return out


def run_all(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[TokenEvent]]:
    """Run requests together to completion; each request's events in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    events: dict[str, list[TokenEvent]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    return [events[rid] for rid in ids]


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]


class NoisyOracleProposer:
    """A test double for the proposer (what is under test is verification): it guesses the reference greedy output,
    each guess replaced by a random token with probability ``noise``, so that every accepted length occurs."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], noise: float, seed: int) -> None:
        self.references = references
        self.lengths = sorted({len(p) for p in references})
        self.noise = noise
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        for n in self.lengths:
            ref = self.references.get(tuple(token_ids[:n]))
            if ref is not None and len(token_ids) > n:
                done = len(token_ids) - n
                if ref[:done] != token_ids[n:]:
                    return []  # a sampled request that left the greedy path
                self.calls += 1
                return [t if self.rng.random() >= self.noise else self.rng.randrange(100, 49000)
                        for t in ref[done : done + max_tokens]]
        return []


@pytest.fixture
def oracle(spec_engine, tiny_engine_f32kv, monkeypatch):
    """Install a noisy oracle on the speculative engine; ``oracle(prompts, max_tokens)`` returns the references."""

    def install(prompts: list[list[int]], max_tokens: int, noise: float = 0.25) -> list[list[int]]:
        refs = tiny_engine_f32kv.generate(prompts, greedy(max_tokens))
        proposer = NoisyOracleProposer({tuple(p): r for p, r in zip(prompts, refs)}, noise, seed=len(prompts))
        monkeypatch.setattr(spec_engine.speculation, "proposer", proposer)
        return refs

    return install


@pytest.fixture(scope="module")
def _spec_session(tiny_gguf):
    # float32 KV, as the reference's: the two paths then agree to the last bit where they compute the same rows.
    return _make_engine(tiny_gguf, kv_cache_dtype="float32", speculative="ngram", speculative_max_running=32)


@pytest.fixture
def spec_engine(_spec_session):
    _assert_clean(_spec_session)
    yield _spec_session
    _assert_clean(_spec_session)


@pytest.fixture(scope="module")
def text_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in TEXT_PROMPTS]


# --- the proposer and the policy ----------------------------------------------------------------------------------


def test_ngram_proposer_continues_the_latest_longest_match():
    p = NgramProposer(max_ngram=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    # The 2-gram (2, 3) matches at the start; the later 1-gram match of 3 would propose something else.
    assert p.propose([2, 3, 7, 8, 3, 9, 2, 3], 2) == [7, 8]
    assert p.propose([1, 2, 3, 9, 2, 3], 5) == [9, 2, 3]  # what follows the match, up to the context's end
    assert p.propose([5, 6, 7], 3) == []
    assert p.propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        NgramProposer(max_ngram=1, min_ngram=2)


class FixedProposer:
    def __init__(self, guess: list[int]) -> None:
        self.guess = guess

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return self.guess[:max_tokens]


def _seq(rid: str, max_tokens: int = 100, **kw):
    from tailguard.engine.sequence import Sequence

    seq = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0, **kw))
    seq.output_token_ids = [4]
    return seq


def test_policy_shrinks_k_then_pauses_a_request_that_accepts_little_and_backs_off():
    policy = SpeculationPolicy(FixedProposer([9] * 8), num_speculative_tokens=4, max_running=8)
    seq = _seq("a")
    assert len(policy.draft(seq)) == 3, "a new request starts one short of the full K"
    policy.record("a", 3, 3)  # EMA 0.69: the full K
    assert len(policy.draft(seq)) == 4
    policy.record("a", 4, 1)  # 0.55: K shrinks
    assert 1 <= len(policy.draft(seq)) < 4
    policy.record("a", 3, 0)  # 0.39: paused
    cooldown = SpeculationPolicy.COOLDOWN_STEPS
    for expected_pause in (cooldown, 2 * cooldown, 4 * cooldown):
        drafts = [policy.draft(seq) for _ in range(expected_pause)]
        assert all(d == [] for d in drafts)
        probe = policy.draft(seq)
        assert probe != [], "a paused request probes again after its cooldown"
        policy.record("a", len(probe), 0)  # a failed probe: paused again, for twice as long
    # A probe that is accepted ends the back-off.
    assert all(policy.draft(seq) == [] for _ in range(8 * cooldown))
    probe = policy.draft(seq)
    policy.record("a", len(probe), len(probe))
    assert policy.draft(seq) != [] and policy.state("a").pauses == 0
    st = policy.forget("a")
    assert st is not None and st.proposed == policy.total_proposed and st.accepted == policy.total_accepted
    # Another request is unaffected; a new request that accepts nothing at first pauses at once.
    assert len(policy.draft(_seq("b"))) == 3
    policy.record("b", 3, 0)
    assert policy.draft(_seq("b")) == []


def test_policy_respects_opt_out_min_tokens_max_tokens_and_batch_size():
    policy = SpeculationPolicy(FixedProposer([9] * 8), num_speculative_tokens=4, max_running=3)
    seq = _seq("a", speculative=False)
    assert policy.draft(seq) == []
    assert policy.draft(_seq("b", min_tokens=5)) == [], "no guesses while stop tokens are banned"
    near_end = _seq("c", max_tokens=3)  # one output so far: two tokens left, a verify step yields guesses + 1
    assert policy.draft(near_end) == [9]
    assert policy.draft(_seq("d", max_tokens=2)) == []
    assert policy.batch_speculates(3) and not policy.batch_speculates(4)


def test_speculative_options_and_bad_values(tiny_gguf):
    from tailguard.engine_options import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"]))
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 6)
    assert engine_args_from(parser.parse_args([])).speculative == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative", "medusa"])
    with pytest.raises(ValueError, match="speculative must be one of"):
        LLMEngine(EngineArgs(model=str(tiny_gguf), speculative="medusa"))
    assert make_proposer("self") is None  # model-based: the engine builds it over its own model (drafting.py)
    assert engine_args_from(parser.parse_args(["--speculative", "draft:/models/small.gguf"])).speculative == (
        "draft:/models/small.gguf")
    with pytest.raises(ValueError, match="at least 1"):
        LLMEngine(EngineArgs(model=str(tiny_gguf), speculative="ngram", num_speculative_tokens=0, kv_cache_tokens=256))


# --- greedy: token for token ----------------------------------------------------------------------------------------


def test_greedy_output_identical_single_stream(spec_engine, tiny_engine_f32kv, text_prompts):
    prompts = text_prompts + repetitive_prompts(6, seed=11)
    before = spec_engine.stats()
    spec_steps = ref_steps = 0
    for i, prompt in enumerate(prompts):
        sp = greedy(100)
        ref_before = tiny_engine_f32kv.steps
        expected = tiny_engine_f32kv.generate([prompt], sp)[0]
        ref_steps += tiny_engine_f32kv.steps - ref_before
        steps_before = spec_engine.steps
        [events] = run_all(spec_engine, [(prompt, sp)])
        spec_steps += spec_engine.steps - steps_before
        assert tokens_of(events) == expected, f"prompt {i} diverged"
        final = events[-1]
        assert final.num_spec_accepted <= final.num_spec_proposed
    stats = spec_engine.stats()
    proposed = stats.num_spec_proposed - before.num_spec_proposed
    accepted = stats.num_spec_accepted - before.num_spec_accepted
    print(f"proposed {proposed}, accepted {accepted}, steps {spec_steps} vs {ref_steps}")
    assert accepted >= 40 and proposed - accepted >= 10, "both accepted and rejected guesses must be exercised"
    assert spec_steps < ref_steps - 20, "accepted guesses must save steps"


def test_greedy_output_identical_with_every_accepted_length(spec_engine, tiny_engine_f32kv, text_prompts, oracle):
    prompts = text_prompts + repetitive_prompts(6, seed=13)
    refs = oracle(prompts, 80)
    before = spec_engine.stats()
    lengths = Counter()
    original_record = spec_engine.speculation.record

    def record(request_id, proposed, accepted):
        lengths[accepted] += 1
        return original_record(request_id, proposed, accepted)

    spec_engine.speculation.record = record
    try:
        for i, (prompt, want) in enumerate(zip(prompts, refs)):
            [events] = run_all(spec_engine, [(prompt, greedy(80))])
            assert tokens_of(events) == want, f"prompt {i} diverged"
    finally:
        del spec_engine.speculation.record
    stats = spec_engine.stats()
    print(f"accepted lengths {sorted(lengths.items())}")
    assert set(lengths) == {0, 1, 2, 3, 4}, "every accepted length, from none to all four guesses, must occur"
    assert stats.num_spec_accepted - before.num_spec_accepted >= 500


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_greedy_identical_in_a_16_stream_batch_mixing_speculating_and_opted_out(
        spec_engine, tiny_engine_f32kv, text_prompts, monkeypatch, oracle, proposer):
    """Also: rolled-back positions are never read. Their K/V is overwritten with huge values at every rollback (and
    the blocks trimmed away carry them to whoever gets them next); any read of them would change the output."""
    prompts = text_prompts[:10] + repetitive_prompts(6, seed=12)
    rng = random.Random(5)
    requests = [(p, greedy(rng.randint(30, 90), speculative=(i % 3 != 0))) for i, p in enumerate(prompts)]
    expected = [tiny_engine_f32kv.generate([p], sp)[0] for p, sp in requests]
    if proposer == "oracle":
        oracle(prompts, 90)

    cache = spec_engine.runner.kv_cache
    flat = cache.view(cache.shape[0], 2, -1, *cache.shape[-2:])
    original = spec_engine.scheduler.roll_back
    poisoned = []

    def poisoning_roll_back(seq, num_accepted):
        table = spec_engine.scheduler.tables[seq.request_id]
        valid = seq.num_computed_tokens + num_accepted
        slots = [table.slot(p) for p in range(valid, table.capacity)]
        flat[:, :, slots] = 1e4
        poisoned.append(len(slots))
        return original(seq, num_accepted)

    monkeypatch.setattr(spec_engine.scheduler, "roll_back", poisoning_roll_back)
    batches: list[int] = []
    original_schedule = spec_engine.scheduler.schedule

    def schedule(*args, **kwargs):
        out = original_schedule(*args, **kwargs)
        batches.append(sum(bool(c.draft) for c in out.chunks) * 100 + len(out.chunks))
        return out

    monkeypatch.setattr(spec_engine.scheduler, "schedule", schedule)
    results = run_all(spec_engine, requests)
    for i, (events, want) in enumerate(zip(results, expected)):
        assert tokens_of(events) == want, f"stream {i} diverged"
        if not requests[i][1].speculative:
            assert events[-1].num_spec_proposed == 0, "an opted-out request was speculated on"
    assert sum(ev[-1].num_spec_accepted for ev in results) >= (20 if proposer == "ngram" else 200)
    assert sum(poisoned) > 0
    assert any(b // 100 and b % 100 >= 8 for b in batches), "speculating and plain sequences never shared a step"


@pytest.mark.real_model
def test_real_model_greedy_identical_with_speculation(smollm2_path, tokenizer):
    engine = LLMEngine(EngineArgs(model="smollm2", kv_cache_tokens=2048, kv_cache_dtype="float32", num_threads=2,
                                  speculative="ngram"))
    prompts = [TEXT_PROMPTS[1], TEXT_PROMPTS[13]]  # repeat-and-fix, English and Chinese
    accepted = 0
    for text in prompts:
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        [plain] = run_all(engine, [(ids, greedy(32, speculative=False))])
        [spec] = run_all(engine, [(ids, greedy(32))])
        assert tokens_of(spec) == tokens_of(plain), text
        accepted += spec[-1].num_spec_accepted
    assert accepted > 10
    _assert_clean(engine)


# --- stop rules when several tokens land at once --------------------------------------------------------------------


def test_stop_rules_hold_exactly_when_several_tokens_are_accepted(spec_engine, tiny_engine_f32kv, monkeypatch,
                                                                    oracle):
    prompts = repetitive_prompts(3, seed=21)
    refs = oracle(prompts, 80, noise=0.1)
    before = spec_engine.stats().num_spec_accepted
    decode = spec_engine.tokenizer.decode
    for prompt, out in zip(prompts, refs):
        variants = [
            greedy(37),
            greedy(61),
            greedy(80, stop_token_ids=[out[50]]),
            greedy(80, stop=[decode(out[45:47])]),
            greedy(80, stop=[decode(out[20:22])], min_tokens=30),
        ]
        for sp in variants:
            [want] = run_all(tiny_engine_f32kv, [(prompt, SamplingParams(**vars(sp)))])
            [got] = run_all(spec_engine, [(prompt, SamplingParams(**vars(sp)))])
            assert tokens_of(got) == tokens_of(want)
            assert "".join(e.text for e in got) == "".join(e.text for e in want)
            assert got[-1].finish_reason is want[-1].finish_reason
            assert got[-1].num_output_tokens == want[-1].num_output_tokens <= sp.max_tokens
    # EOS: make a token of the output the end of sequence.
    prompt, out = prompts[0], refs[0]
    for engine in (spec_engine, tiny_engine_f32kv):
        monkeypatch.setattr(engine, "stop_ids", {out[48]})
    [want] = run_all(tiny_engine_f32kv, [(prompt, greedy(80, ignore_eos=False))])
    [got] = run_all(spec_engine, [(prompt, greedy(80, ignore_eos=False))])
    assert tokens_of(got) == tokens_of(want) and got[-1].finish_reason is FinishReason.STOP
    assert spec_engine.stats().num_spec_accepted - before >= 200, "guesses were not accepted several at a time"


# --- sampling: the target's distribution ------------------------------------------------------------------------------


def _verify_logits(engine, prompt: list[int], draft: list[int]) -> torch.Tensor:
    """The tiny model's logits at a decoding sequence's pending token and after each guess (one verify pass)."""
    rid = engine.add_request(prompt, greedy(8))
    while not engine.scheduler.running or not engine.scheduler.running[0].in_decode:
        engine.step()
    seq = engine.scheduler.running[0]
    table = engine.scheduler.tables[rid]
    assert table.ensure(seq.num_tokens + len(draft))
    chunk = ScheduledChunk(seq, seq.num_computed_tokens, 1 + len(draft), list(draft))
    input_ids, meta, logits_indices = engine.runner._build([chunk], engine.scheduler.tables)
    logits = engine.model.forward(input_ids, meta, engine.runner.kv_cache, logits_indices)
    engine.abort(rid)
    return logits


def _tv(a: Counter, b: dict[int, float], n: int) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0) / n - b.get(k, 0.0)) for k in keys)


def _tv_bound(exact: dict[int, float], n: int) -> float:
    """Three times the expected total variation of n exact samples (0.5 * sum of each count's standard deviation
    times sqrt(2/pi)), plus a little: a sampler off by a few percent of mass exceeds it."""
    return 3 * 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact.values()) + 0.005


# top-p sorts the whole vocabulary at every draw: fewer samples there (the bound widens with them).
@pytest.mark.parametrize(("params", "n"), [(dict(temperature=0.8, top_k=8), 2500), (dict(temperature=0.5, top_p=0.6), 1200)])
def test_rejection_sampling_preserves_the_target_distribution(spec_engine, params, n):
    from tailguard.engine.sequence import Sequence

    runner = spec_engine.runner
    prompt = repetitive_prompts(1, seed=31)[0]
    sp = SamplingParams(max_tokens=8, seed=1234, **params)
    probe = _verify_logits(spec_engine, prompt, [0])
    p0 = runner._probs(probe[0], sp)
    support = (p0 > 0).sum().item()
    assert 3 <= support <= 128, f"the test wants a spread but small support, got {support}"
    guess = int(torch.argsort(p0, descending=True)[1])  # the second most likely: accepted sometimes, not always
    logits = _verify_logits(spec_engine, prompt, [guess])
    p0, p1 = runner._probs(logits[0], sp), runner._probs(logits[1], sp)
    exact0 = {i: float(p0[i]) for i in torch.nonzero(p0).flatten().tolist()}
    exact1 = {i: float(p1[i]) for i in torch.nonzero(p1).flatten().tolist()}

    seq = Sequence("dist-spec", prompt, sp)
    first, second = Counter(), Counter()
    for _ in range(n):
        toks = runner.verify(logits, seq, [guess])
        first[toks[0].token_id] += 1
        if toks[0].token_id == guess:
            assert len(toks) == 2
            second[toks[1].token_id] += 1
        else:
            assert len(toks) == 1
    runner.release("dist-spec")
    plain_seq = Sequence("dist-plain", prompt, sp)
    plain = Counter(runner._sample_one(logits[0:1], plain_seq, set()) for _ in range(n))
    runner.release("dist-plain")

    tv_spec, tv_plain = _tv(first, exact0, n), _tv(plain, exact0, n)
    tv_second = _tv(second, exact1, sum(second.values()))
    print(f"support {support}, p(guess) {exact0[guess]:.3f}: TV spec {tv_spec:.4f}, plain {tv_plain:.4f}, "
          f"second {tv_second:.4f} over {sum(second.values())}")
    assert 0.05 < exact0[guess] < 0.95
    bound = _tv_bound(exact0, n)
    assert tv_spec < bound and tv_plain < bound, f"bound {bound:.4f}"
    assert tv_second < _tv_bound(exact1, sum(second.values()))
    # A guess the transforms rule out (outside top-k / top-p) is never emitted.
    outside = int(torch.argsort(p0)[0])
    assert float(p0[outside]) == 0.0
    logits_out = _verify_logits(spec_engine, prompt, [outside])
    seq2 = Sequence("dist-outside", prompt, sp)
    assert all(runner.verify(logits_out, seq2, [outside])[0].token_id != outside for _ in range(50))
    runner.release("dist-outside")


def test_sampled_requests_speculate_and_finish(spec_engine):
    prompts = repetitive_prompts(8, seed=41)
    requests = [(p, SamplingParams(max_tokens=60, temperature=0.3, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]
    results = run_all(spec_engine, requests)
    assert all(ev[-1].num_output_tokens == 60 and len(tokens_of(ev)) == 60 for ev in results)
    assert sum(ev[-1].num_spec_proposed for ev in results) > 0


# --- KV blocks ------------------------------------------------------------------------------------------------------


def test_no_leaked_blocks_after_200_speculative_requests_with_aborts_and_preemptions(tiny_gguf, tiny_engine_f32kv):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=384, max_num_seqs=16, kv_cache_dtype="float32",
                          speculative="ngram", speculative_max_running=16)
    rng = random.Random(3)
    prompts = [p[:90] for p in repetitive_prompts(200, seed=51)]
    refs = tiny_engine_f32kv.generate(prompts, greedy(40))
    engine.speculation.proposer = NoisyOracleProposer({tuple(p): r for p, r in zip(prompts, refs)}, 0.2, seed=1)
    pending = []
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.0, 0.8]),
                            seed=rng.choice([None, i]), ignore_eos=True, speculative=rng.random() < 0.8)
        pending.append((f"leak-{i}", prompt, sp, rng.randint(0, 2)))
    wanted = {rid: sp.max_tokens for rid, _, sp, _ in pending}
    max_used = 0

    def check() -> None:
        nonlocal max_used
        max_used = max(max_used, engine.pool.num_used)
        assert engine.pool.num_used == sum(len(t.blocks) for t in engine.scheduler.tables.values())
        for seq in engine.scheduler.running:  # after a step, no sequence holds blocks past what it needs
            assert len(engine.scheduler.tables[seq.request_id].blocks) <= engine.pool.blocks_for(seq.num_tokens)

    final = churn(engine, pending, rng, check)
    stats = engine.stats()
    print(f"preemptions {stats.num_preemptions}, proposed {stats.num_spec_proposed}, accepted {stats.num_spec_accepted}")
    assert stats.num_preemptions > 0 and max_used == engine.pool.num_blocks, "the workload was meant to fill the KV"
    assert stats.num_spec_accepted > 100
    assert len(final) == 200
    aborted = [r for r, ev in final.items() if ev.finish_reason is FinishReason.ABORT]
    assert 5 <= len(aborted) <= 100
    for rid, ev in final.items():
        if ev.finish_reason is not FinishReason.ABORT:
            assert ev.finish_reason is FinishReason.LENGTH and ev.num_output_tokens == wanted[rid], rid
    _assert_clean(engine)
    assert engine.speculation.states == {}, "per-request speculation state leaked"


def test_batch_stops_speculating_above_the_running_threshold(tiny_gguf, monkeypatch):
    engine = _make_engine(tiny_gguf, kv_cache_dtype="float32", speculative="ngram", speculative_max_running=3)
    seen: list[tuple[int, int]] = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        running = len(engine.scheduler.running)
        out = original(*args, **kwargs)
        seen.append((running, sum(bool(c.draft) for c in out.chunks)))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    prompts = repetitive_prompts(6, seed=61)
    run_all(engine, [(p, greedy(20 + 15 * i)) for i, p in enumerate(prompts)])
    assert all(drafts == 0 for running, drafts in seen if running > 3)
    assert any(drafts > 0 for running, drafts in seen if running <= 3), "speculation never resumed"
    _assert_clean(engine)
