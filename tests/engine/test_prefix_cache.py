"""Prefix caching: content hashes, the reference-counted LRU pool, the scheduler's cache hits, and the engine's output
with the cache on and off (tiny random model; identical greedy tokens are the proof that shared KV is the right KV)."""

from __future__ import annotations

import argparse
import random

import pytest

from tailguard.engine.blocks import BlockPool, BlockTable
from tailguard.engine.engine import TokenEvent
from tailguard.engine.prefix_cache import ROOT_HASH, block_hashes, cacheable_prefix_blocks, hash_block
from tailguard.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from tailguard.engine_options import add_engine_args, engine_args_from
from tests.conftest import _assert_clean, _make_engine, churn
from tests.engine.test_scheduler import check_pool_accounting, make_scheduler, step

BS = 16


def greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def seq_of(rid: str, tokens: list[int], max_tokens: int = 4, priority: int = 0, arrival: float = 0.0) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0), priority=priority,
                    arrival_time=arrival)


# --- hashes -------------------------------------------------------------------------------------------------------


def test_block_hash_chains_the_parent_and_the_tokens():
    a = list(range(100, 148))
    hashes = block_hashes(a, BS, 3)
    assert len(hashes) == len(set(hashes)) == 3
    assert hashes == block_hashes(a + [5, 6], BS, 3), "a block's hash depends only on the tokens up to its end"
    # The same block of tokens after a different first block hashes differently: the prefix is part of the key.
    b = [1] * BS + a[BS:]
    assert block_hashes(b, BS, 3)[1] != hashes[1] and block_hashes(b, BS, 3)[1:] != hashes[1:]
    assert hash_block(ROOT_HASH, a[:BS]) == hashes[0]
    assert hash_block(ROOT_HASH, a[:BS - 1] + [0]) != hashes[0]
    # Incremental extension gives the same chain.
    known = block_hashes(a, BS, 1)
    assert block_hashes(a, BS, 3, known) == hashes and known == hashes
    with pytest.raises(ValueError):
        block_hashes(a, BS, 4)


def test_cacheable_prefix_always_leaves_the_last_token_to_compute():
    assert [cacheable_prefix_blocks(n, BS) for n in (0, 1, 15, 16, 17, 32, 33, 48)] == [0, 0, 0, 0, 1, 1, 2, 2]


# --- the pool -----------------------------------------------------------------------------------------------------


def test_shared_blocks_are_reference_counted_and_keep_their_content_when_freed():
    pool = BlockPool(6, block_size=4)
    a = BlockTable(pool, "a")
    assert a.ensure(12)
    hashes = block_hashes(list(range(12)), 4, 3)
    for block, h in zip(a.blocks, hashes):
        assert pool.register(block, h)
    assert not pool.register(a.blocks[0], hashes[0]), "a block registers once"
    b = BlockTable(pool, "b")
    hits = pool.lookup(hashes[:2] + [b"unknown"])
    assert hits == a.blocks[:2]
    b.attach_cached(hits)
    assert [pool.refcount(x) for x in a.blocks] == [2, 2, 1]
    assert pool.num_used == 3 and pool.owners() == {"a", "b"}
    with pytest.raises(ValueError):
        pool.free([a.blocks[0]])  # shared: the owner must be named
    a.release()
    assert pool.num_used == 2 and pool.owners() == {"b"}
    assert pool.num_free == 4 and pool.num_cached == 3, "a freed block keeps its cached content"
    b.release()
    assert pool.num_used == 0 and pool.owners() == set() and pool.num_cached == 3
    # Unreferenced cached blocks can be taken back, and they come out of the free list when they are.
    c = BlockTable(pool, "c")
    hits = pool.lookup(hashes)
    assert len(hits) == 3 and pool.num_unreferenced(hits) == 3
    c.attach_cached(hits)
    assert pool.num_free == 3 and pool.num_used == 3
    c.release()
    with pytest.raises(ValueError):
        BlockTable(pool, "d").attach_cached([5])  # never cached
    assert pool.num_free == 6


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed():
    pool = BlockPool(4, block_size=4)
    tables = [BlockTable(pool, f"t{i}") for i in range(4)]
    hashes = [hash_block(ROOT_HASH, [i] * 4) for i in range(4)]
    for i, t in enumerate(tables):
        assert t.ensure(4)
        if i < 3:
            pool.register(t.blocks[0], hashes[i])
    blocks = [t.blocks[0] for t in tables]
    for i in (1, 0, 3, 2):  # free order: t1 (cached), t0 (cached), t3 (uncached), t2 (cached)
        tables[i].release()
    taker = BlockTable(pool, "taker")
    assert taker.ensure(4) and taker.blocks == [blocks[3]], "an uncached free block is reused before cached ones"
    assert taker.ensure(8) and taker.blocks[1] == blocks[1], "then the least recently freed cached block"
    assert pool.lookup([hashes[1]]) == [] and pool.num_evictions == 1, "an evicted block is no longer found"
    assert pool.lookup([hashes[0]]) == [blocks[0]] and pool.lookup([hashes[2]]) == [blocks[2]]
    taker.release()


def test_trim_never_drops_full_cached_blocks():
    pool = BlockPool(8, block_size=4)
    table = BlockTable(pool, "r")
    table.ensure(12)
    table.num_cached = 2
    table.trim(9)
    assert len(table.blocks) == 3
    with pytest.raises(ValueError):
        table.trim(4)
    table.release()
    assert pool.num_used == 0


# --- the scheduler ------------------------------------------------------------------------------------------------


def run(sched, max_steps: int = 10_000):
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps
    return outs


def computed_tokens(outs, rid: str) -> int:
    """Tokens a request had computed (written into the KV cache) over its life."""
    return sum(c.num_tokens for out in outs for c in out.chunks if c.seq.request_id == rid)


def test_a_repeated_system_prompt_is_computed_once():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=256, max_prefill_chunk=64)
    system = [100 + i for i in range(100)]  # 6 full blocks and 4 tokens
    first = seq_of("first", system + [1, 2, 3], max_tokens=3)
    sched.add(first)
    outs = run(sched)
    assert computed_tokens(outs, "first") == 103 + 2 and first.num_cached_tokens == 0
    second = seq_of("second", system + [7, 8, 9, 10], max_tokens=3)
    sched.add(second)
    outs = run(sched)
    # The 6 full blocks of the system prompt come from the cache; only the rest of the prompt is computed.
    assert second.num_cached_tokens == 96
    assert computed_tokens(outs, "second") == 104 - 96 + 2
    assert outs[0].chunks[0].start == 96
    assert sched.prefix_cache_queries == 103 + 104 and sched.prefix_cache_hits == 96
    check_pool_accounting(sched)
    assert sched.pool.num_used == 0


def test_a_fully_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=256, max_prefill_chunk=64)
    prompt = [100 + i for i in range(64)]  # exactly 4 blocks
    sched.add(seq_of("a", prompt, max_tokens=1))
    run(sched)
    again = seq_of("b", prompt, max_tokens=1)
    sched.add(again)
    outs = run(sched)
    assert again.num_cached_tokens == 48, "the block holding the last prompt token is recomputed (logits needed)"
    assert outs[0].chunks[0].start == 48 and outs[0].chunks[0].end == 64, "one chunk to the prompt's end"


def test_multi_turn_chat_reuses_the_previous_turns_output_blocks():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=256, max_prefill_chunk=64)
    turn1 = seq_of("t1", [100 + i for i in range(40)], max_tokens=30)
    sched.add(turn1)
    run(sched)
    history = turn1.prompt_token_ids + turn1.output_token_ids  # 70 tokens; KV computed for the first 69
    turn2 = seq_of("t2", history + [5, 6, 7], max_tokens=2)
    sched.add(turn2)
    run(sched)
    assert turn2.num_cached_tokens == 64, "blocks filled by the first turn's output are shared too"


def test_a_preempted_request_gets_its_own_cached_blocks_back():
    sched = make_scheduler(num_blocks=12, max_num_batched_tokens=128, max_prefill_chunk=64, max_num_seqs=2)
    low = seq_of("low", [100 + i for i in range(60)], max_tokens=40, priority=5, arrival=1.0)
    sched.add(low)
    for _ in range(4):
        step(sched)
    assert low.status is SequenceStatus.RUNNING and low.num_computed_tokens >= 60
    vip = seq_of("vip", [300 + i for i in range(120)], max_tokens=4, priority=0, arrival=2.0)
    sched.add(vip)
    hits_before = sched.prefix_cache_hits
    outs = run(sched)
    assert low.num_preemptions >= 1 and any(low in out.preempted for out in outs)
    assert sched.prefix_cache_hits - hits_before >= 48, "the preempted request recomputed what was still cached"
    assert low.num_cached_tokens == 0, "the per-request figure is its first admission's"
    assert sched.pool.num_used == 0


def test_no_leaked_references_after_200_requests_with_shared_prefixes_aborts_and_preemptions():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=40, max_num_batched_tokens=96, max_prefill_chunk=48, max_num_seqs=8)
    systems = [[rng.randrange(1000, 2000) for _ in range(rng.randint(20, 70))] for _ in range(4)]
    pending = []
    for i in range(200):
        prompt = rng.choice(systems) + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 30))]
        pending.append(seq_of(f"r{i}", prompt, max_tokens=rng.randint(1, 40), priority=rng.randint(0, 2),
                              arrival=float(i)))
    pending.reverse()
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add(pending.pop())
        for seq in list(sched.running):
            table = sched.tables[seq.request_id]
            for b in table.blocks:  # eviction never takes a block a running sequence holds
                assert sched.pool.refcount(b) >= 1
        step(sched)
        live = sched.running + sched.waiting
        if live and rng.random() < 0.1:
            sched.finish(rng.choice(live), FinishReason.ABORT)
    assert sched.num_preemptions > 0, "the workload was meant to preempt"
    assert sched.prefix_cache_hits > 0 and sched.pool.num_evictions > 0
    assert sched.pool.num_used == 0 and sched.pool.num_free == sched.pool.num_blocks
    assert sched.pool.owners() == set() and sched.tables == {}
    assert all(sched.pool.refcount(b) == 0 for b in range(sched.pool.num_blocks))


def test_prefix_caching_off_never_shares():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=256, max_prefill_chunk=64, enable_prefix_caching=False)
    for rid in ("a", "b"):
        sched.add(seq_of(rid, [100 + i for i in range(50)], max_tokens=2))
        run(sched)
    assert sched.prefix_cache_hits == 0 and sched.prefix_cache_queries == 0 and sched.pool.num_cached == 0


def test_command_line_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).enable_prefix_caching is True
    assert engine_args_from(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    assert engine_args_from(parser.parse_args(["--no-prefix-caching"])).enable_prefix_caching is False


# --- the engine on the tiny model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_gguf):
    """Cache on and off, float32 KV for both (so a recomputed position reproduces a decoded one exactly)."""
    common = dict(kv_cache_dtype="float32", kv_cache_tokens=4096)
    return _make_engine(tiny_gguf, **common), _make_engine(tiny_gguf, enable_prefix_caching=False, **common)


def run_all(engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[TokenEvent]]:
    ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p, sp in requests]
    events: dict[str, list[TokenEvent]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            events[ev.request_id].append(ev)
    _assert_clean(engine)
    return [events[rid] for rid in ids]


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]


def count_computed(engine, monkeypatch) -> dict[str, int]:
    """Tokens each request had computed by the model (spying on the runner, which computes what it is given)."""
    counts: dict[str, int] = {}
    original = engine.runner.execute

    def execute(chunks, *args, **kwargs):
        for c in chunks:
            counts[c.seq.request_id] = counts.get(c.seq.request_id, 0) + c.num_tokens
        return original(chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return counts


@pytest.fixture(scope="module")
def system_prompt(tokenizer) -> list[int]:
    text = ("You are a helpful assistant for a bicycle shop. Answer briefly, politely and only about bicycles, "
            "their parts, repairs and prices. ") * 3
    return tokenizer.encode_chat([{"role": "system", "content": text}])


def chat(tokenizer, system_prompt, question: str) -> list[int]:
    return system_prompt + tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def test_engine_computes_a_repeated_system_prompt_once(engines, tokenizer, system_prompt, monkeypatch):
    cached, plain = engines
    counts = count_computed(cached, monkeypatch)
    before = cached.stats()
    prompts = [chat(tokenizer, system_prompt, q) for q in ("How do I fix a flat tyre?", "What does a chain cost?")]
    first = run_all(cached, [(prompts[0], greedy(5))])[0]
    second = run_all(cached, [(prompts[1], greedy(5))])[0]
    full_blocks = len(system_prompt) // BS
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens >= full_blocks * BS
    assert counts[second[-1].request_id] == len(prompts[1]) - second[-1].num_cached_tokens + 4
    assert counts[first[-1].request_id] == len(prompts[0]) + 4
    stats = cached.stats()
    assert stats.prefix_cache_queries - before.prefix_cache_queries == len(prompts[0]) + len(prompts[1])
    assert stats.prefix_cache_hits - before.prefix_cache_hits == second[-1].num_cached_tokens
    assert stats.kv_blocks_cached >= full_blocks
    # Same tokens as the engine without a cache.
    assert [tokens_of(first), tokens_of(second)] == [tokens_of(e) for e in run_all(plain, [(p, greedy(5)) for p in prompts])]


def test_outputs_identical_with_and_without_the_cache_multi_turn_and_16_streams(engines, tokenizer, system_prompt):
    cached, plain = engines
    questions = ["How do I fix a flat tyre?", "What does a chain cost?", "Which saddle is best?",
                 "How often should I oil the chain?", "Are disc brakes better?", "What size frame do I need?",
                 "How do I adjust gears?", "What pressure for my tyres?"]
    # Multi-turn: each conversation's second turn repeats the first turn and its answer.
    turn1 = [(chat(tokenizer, system_prompt, q), greedy(24)) for q in questions]
    outs1 = run_all(cached, turn1)
    ref1 = run_all(plain, turn1)
    assert [tokens_of(e) for e in outs1] == [tokens_of(e) for e in ref1]
    turn2 = []
    for (prompt, _), events in zip(turn1, outs1):
        follow = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
        turn2.append((prompt + tokens_of(events) + follow, greedy(20)))
    # 16 streams at once: the 8 second turns and 8 new conversations on the same system prompt.
    batch = turn2 + [(chat(tokenizer, system_prompt, q + " Please."), greedy(20)) for q in questions]
    hits_before = cached.stats().prefix_cache_hits
    outs2 = run_all(cached, batch)
    ref2 = run_all(plain, batch)
    for i, (got, want) in enumerate(zip(outs2, ref2)):
        assert tokens_of(got) == tokens_of(want), f"stream {i} diverged with the prefix cache"
    for events, (prompt, _) in zip(outs2[:8], turn2):
        assert events[-1].num_cached_tokens >= (len(prompt) - 40) // BS * BS - BS, "a second turn missed its history"
    assert cached.stats().prefix_cache_hits > hits_before
    assert plain.stats().prefix_cache_hits == 0 and plain.pool.num_cached == 0


def test_eviction_under_pressure_keeps_outputs_identical(tiny_gguf, engines, tokenizer, system_prompt):
    """A KV cache of 24 blocks: cached blocks are evicted, requests preempted; every output stays the reference's."""
    _, plain = engines
    small = _make_engine(tiny_gguf, kv_cache_tokens=384, max_num_seqs=16, kv_cache_dtype="float32")
    rng = random.Random(11)
    systems = [system_prompt[:n] for n in (40, 70)] + [[rng.randrange(100, 49000) for _ in range(50)]]
    requests = []
    for _ in range(24):
        tail = [rng.randrange(100, 49000) for _ in range(rng.randint(1, 30))]
        requests.append((rng.choice(systems) + tail, greedy(rng.randint(5, 40))))
    got = run_all(small, requests)
    want = run_all(plain, requests)
    for i, (g, w) in enumerate(zip(got, want)):
        assert tokens_of(g) == tokens_of(w), f"request {i} diverged under eviction"
    stats = small.stats()
    assert stats.prefix_cache_hits > 0 and small.pool.num_evictions > 0 and stats.num_preemptions > 0
    assert small.pool.num_free == small.pool.num_blocks


def test_no_leaked_references_after_200_engine_requests_with_aborts(tiny_gguf):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=384, max_num_seqs=16)
    rng = random.Random(3)
    systems = [[rng.randrange(100, 49000) for _ in range(rng.randint(16, 60))] for _ in range(3)]
    pending = []
    for i in range(200):
        prompt = rng.choice(systems) + [rng.randrange(100, 49000) for _ in range(rng.randint(1, 20))]
        sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.8]), ignore_eos=True)
        pending.append((f"leak-{i}", prompt, sp, rng.randint(0, 2)))
    final = churn(engine, pending, rng)
    stats = engine.stats()
    assert len(final) == 200 and stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert sum(ev.finish_reason is FinishReason.ABORT for ev in final.values()) >= 5
    assert sum(ev.num_cached_tokens for ev in final.values()) > 0
    _assert_clean(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(engine.pool.refcount(b) == 0 for b in range(engine.pool.num_blocks))


def test_speculative_decoding_with_prefix_caching_gives_identical_greedy_output(tiny_gguf, engines, tokenizer,
                                                                                system_prompt):
    _, plain = engines
    spec = _make_engine(tiny_gguf, kv_cache_dtype="float32", speculative="ngram", speculative_max_running=32)
    rng = random.Random(5)
    base = [rng.randrange(100, 49000) for _ in range(12)]
    repetitive = system_prompt + base * 3  # the n-gram proposer finds matches: many guesses, many rollbacks
    requests = [(repetitive + [rng.randrange(100, 49000) for _ in range(rng.randint(1, 9))], greedy(40))
                for _ in range(6)]
    first = run_all(spec, requests[:2])  # fills the cache
    rest = run_all(spec, requests[2:])  # hits it, 4 streams at once
    want = run_all(plain, requests)
    assert [tokens_of(e) for e in first + rest] == [tokens_of(e) for e in want]
    assert all(e[-1].num_cached_tokens >= len(system_prompt) // BS * BS for e in rest)
    assert spec.stats().num_spec_accepted > 0


def test_block_boundary_prompts_one_token_or_one_block_left_to_compute(engines, system_prompt):
    """A prompt one token past a block boundary computes just that token (a one-row chunk, run like a decode); a
    prompt that ends on a boundary recomputes its whole last block (logits are needed at its last position)."""
    cached, plain = engines
    requests = [(system_prompt[:48] + [4242], greedy(8)), (system_prompt[:64], greedy(8))]
    warm = [(system_prompt[:48] + [17, 18], greedy(2)), (system_prompt[:64] + [19], greedy(2))]
    run_all(cached, warm)
    got = run_all(cached, requests)
    assert [e[-1].num_cached_tokens for e in got] == [48, 48]
    assert [tokens_of(e) for e in got] == [tokens_of(e) for e in run_all(plain, requests)]
