"""The chunked-prefill scheduler, driven step by step with hand-made sequences and fake output tokens (no torch)."""

from __future__ import annotations

import itertools
import random

import pytest

from tailguard.engine.blocks import BlockPool
from tailguard.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tailguard.engine.sequence import FinishReason, RequestError, SamplingParams, Sequence, SequenceStatus

FAKE_TOKEN = 7


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


_arrivals = itertools.count(1)


def make_seq(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float | None = None) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=[100 + i for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        priority=priority,
        arrival_time=float(next(_arrivals)) if arrival is None else arrival,
    )


def make_scheduler(num_blocks=64, block_size=16, **config) -> Scheduler:
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks, block_size), clock=FakeClock())


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    # A step passes its token budget, by at most the overrun, only when its last prefill chunk finishes its prompt.
    overrun = out.num_tokens - cfg.max_num_batched_tokens
    assert overrun <= cfg.max_prefill_overrun, "per-step token budget exceeded"
    if overrun > 0:
        last = out.chunks[-1]
        assert not last.is_decode and last.end == last.seq.num_tokens, "only a prompt's last chunk may overrun"
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [c.seq.request_id for c in out.chunks]
    assert len(ids) == len(set(ids)), "a sequence got two chunks in one step"
    seen_prefill = False
    for c in out.chunks:
        assert c.num_tokens >= 1
        assert c.num_tokens <= cfg.max_prefill_chunk or (
            c.end == c.seq.num_tokens and c.num_tokens <= cfg.max_prefill_chunk + cfg.max_prefill_overrun)
        assert c.seq.status is SequenceStatus.RUNNING and c.seq in sched.running
        assert c.start == c.seq.num_computed_tokens, "a chunk must start where the KV cache ends"
        assert c.end <= c.seq.num_tokens
        assert sched.tables[c.seq.request_id].capacity >= c.end, "chunk scheduled without KV blocks for it"
        if c.is_decode:
            assert not seen_prefill, "decodes must come before prefill chunks"
        else:
            seen_prefill = True
    for victim in out.preempted:
        assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0
        assert sched.tables[victim.request_id].blocks == []
    # The pool's accounting agrees with the tables: a block shared by several tables (prefix caching) counts once,
    # and its reference count is the number of tables holding it.
    check_pool_accounting(sched)
    for c in out.chunks:
        table = sched.tables[c.seq.request_id]
        assert c.start >= table.num_cached * sched.pool.block_size, "a chunk writes into a full, cached block"
    for seq in sched.waiting:
        assert sched.tables[seq.request_id].blocks == [], "a waiting sequence holds KV blocks"


def check_pool_accounting(sched: Scheduler) -> None:
    held: dict[int, int] = {}
    for table in sched.tables.values():
        assert len(set(table.blocks)) == len(table.blocks), "a table holds a block twice"
        for b in table.blocks:
            held[b] = held.get(b, 0) + 1
    assert sched.pool.num_used == len(held)
    for b, n in held.items():
        assert sched.pool.refcount(b) == n, f"block {b}: refcount {sched.pool.refcount(b)}, held by {n} tables"


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run' (advance), append a fake token where a chunk samples, finish at max_tokens."""
    out = sched.schedule()
    check_invariants(sched, out)
    out.decode_ids = {c.seq.request_id for c in out.chunks if c.is_decode}  # before the fake token lands
    sampling = [c.seq for c in out.chunks if c.samples]
    sched.advance(out)
    for seq in sampling:
        seq.output_token_ids.append(FAKE_TOKEN)
        if len(seq.output_token_ids) >= seq.sampling.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return out


def start_streams(sched: Scheduler, n: int, prompt_len: int = 5, max_tokens: int = 100) -> list[Sequence]:
    """``n`` short prompts prefilled together in one step: streams that decode from the next step on."""
    streams = [make_seq(f"s{i}", prompt_len, max_tokens=max_tokens) for i in range(n)]
    for s in streams:
        sched.add(s)
    step(sched)
    return streams


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


# --- configuration ------------------------------------------------------------------------------------------------


def test_config_requires_budget_for_every_decode():
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=32)


# --- check_fits ---------------------------------------------------------------------------------------------------


def test_check_fits_rejects_prompt_at_or_over_context():
    sched = make_scheduler(max_model_len=100)
    for n in (100, 150):
        with pytest.raises(RequestError) as err:
            sched.check_fits(n, 1)
        msg = str(err.value)
        assert str(n) in msg and "100" in msg and "context window" in msg


def test_check_fits_rejects_prompt_plus_max_tokens_over_context():
    sched = make_scheduler(max_model_len=100)
    with pytest.raises(RequestError) as err:
        sched.check_fits(60, 41)
    msg = str(err.value)
    for number in ("60", "41", "101", "100"):
        assert number in msg, f"{number} missing from {msg!r}"
    assert "at most 40" in msg, "the message should say how far max_tokens can go"
    sched.check_fits(60, 40)  # exactly at the limit is fine
    sched.check_fits(99, 1)


def test_check_fits_rejects_empty_prompt_and_kv_overflow():
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=1000)
    with pytest.raises(RequestError, match="empty"):
        sched.check_fits(0, 1)
    with pytest.raises(RequestError, match="KV"):
        sched.check_fits(60, 5)  # 65 tokens need 5 blocks of 16; the pool has 4
    sched.check_fits(60, 4)


def test_add_checks_fit_and_duplicate_ids():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(RequestError):
        sched.add(make_seq("long", 64, max_tokens=1))
    assert not sched.has_unfinished() and "long" not in sched.tables
    sched.add(make_seq("a", 10))
    with pytest.raises(RequestError, match="duplicate"):
        sched.add(make_seq("a", 10))
    assert sched.num_waiting == 1


# --- budget, chunking, starvation -------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_and_decodes_run_every_step():
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=32)
    streams = start_streams(sched, 3)
    assert all(s.in_decode for s in streams)

    long = make_seq("long", 200, max_tokens=2)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = step(sched)
        by_id = {c.seq.request_id: c for c in out.chunks}
        # Every running stream decodes in the same step as the prefill chunk: prefill never starves them.
        for s in streams:
            assert s.request_id in out.decode_ids
        chunk = by_id["long"]
        assert "long" not in out.decode_ids
        chunks.append((chunk.start, chunk.num_tokens))
    assert [n for _, n in chunks] == [32] * 6 + [8]
    starts = [s for s, _ in chunks]
    assert starts == [0, 32, 64, 96, 128, 160, 192], "chunks must be contiguous"
    assert long.output_token_ids == [FAKE_TOKEN], "only the last chunk samples"
    for s in streams:
        sched.finish(s, FinishReason.ABORT)
    run_to_completion(sched)
    assert sched.pool.num_used == 0


def test_prefill_chunk_shrinks_to_fit_the_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=40, max_prefill_chunk=256)
    start_streams(sched, 3, prompt_len=3, max_tokens=50)
    long = make_seq("long", 100, max_tokens=1)
    sched.add(long)
    out = step(sched)
    sizes = {c.seq.request_id: c.num_tokens for c in out.chunks}
    assert sizes == {"s0": 1, "s1": 1, "s2": 1, "long": 37}
    assert out.num_tokens == 40


def prompt_chunks(sched: Scheduler, seq: Sequence) -> list[int]:
    """Step until ``seq``'s prompt is in the KV cache; the size of its chunk in each step."""
    sizes = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out = step(sched)
        sizes.append(sum(c.num_tokens for c in out.chunks if c.seq is seq))
        assert len(sizes) < 100
    return sizes


@pytest.mark.parametrize("prompt_len, overrun, sizes", [
    (520, 64, [520]),  # 8 tokens over the budget: finished in the same step, not a second one
    (576, 64, [576]),  # exactly the overrun
    (577, 64, [512, 65]),  # one more: two chunks as before
    (520, 0, [512, 8]),  # overrun off
])
def test_a_prompt_just_over_the_budget_finishes_in_one_step(prompt_len, overrun, sizes):
    sched = make_scheduler(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=512,
                           prefill_overrun_tokens=overrun)
    seq = make_seq("p", prompt_len, max_tokens=2)
    sched.add(seq)
    assert prompt_chunks(sched, seq) == sizes
    assert seq.output_token_ids == [FAKE_TOKEN], "the prompt's last chunk samples its first token"


def test_decode_rows_do_not_push_a_budget_sized_prompt_into_a_second_step():
    sched = make_scheduler(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=512,
                           enable_prefix_caching=False)
    streams = start_streams(sched, 6)
    seq = make_seq("p", 511, max_tokens=2)
    sched.add(seq)
    sched.add(make_seq("q", 5, max_tokens=2))
    out = step(sched)
    # Six decode rows leave 506 tokens of the budget; the prompt's last 5 tokens join its chunk instead of taking a
    # step of their own, and nothing else is admitted into a step already past its budget.
    assert {c.seq.request_id: c.num_tokens for c in out.chunks} == {**{s.request_id: 1 for s in streams}, "p": 511}
    assert out.num_tokens == 517 and seq.output_token_ids == [FAKE_TOKEN]
    assert sched.num_waiting == 1


def test_the_overrun_is_an_eighth_of_a_small_budget_at_most():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=32, enable_prefix_caching=False)
    assert sched.config.max_prefill_overrun == 4
    seq = make_seq("p", 68, max_tokens=1)
    sched.add(seq)
    assert prompt_chunks(sched, seq) == [32, 36]  # 4 over the chunk cap finishes; 36 over it would not
    seq = make_seq("q", 69, max_tokens=1)
    sched.add(seq)
    assert prompt_chunks(sched, seq) == [32, 32, 5]


def test_budget_never_exceeded_in_a_random_workload_with_preemptions():
    rng = random.Random(1234)
    sched = make_scheduler(num_blocks=40, block_size=8, max_model_len=512, max_num_seqs=6,
                           max_num_batched_tokens=48, max_prefill_chunk=20)
    seqs: list[Sequence] = []
    pending = [make_seq(f"r{i}", rng.randint(1, 120), max_tokens=rng.randint(1, 40), priority=rng.randint(0, 2))
               for i in range(60)]
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                seq = pending.pop()
                sched.add(seq)
                seqs.append(seq)
        step(sched)
        steps += 1
        assert steps < 20_000
    assert sched.num_preemptions > 0, "the workload was meant to exhaust the pool"
    assert all(s.is_finished and s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert all(len(s.output_token_ids) == s.sampling.max_tokens for s in seqs), "a preempted sequence lost tokens"
    assert sched.pool.num_used == 0 and sched.pool.owners() == set() and sched.tables == {}


# --- limits and priorities ----------------------------------------------------------------------------------------


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [make_seq(f"r{i}", 4, max_tokens=3) for i in range(10)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert len(out.chunks) == 3 and len(sched.running) == 3 and sched.num_waiting == 7
    max_running = 0
    while sched.has_unfinished():
        step(sched)
        max_running = max(max_running, len(sched.running))
    assert max_running == 3
    # First come, first served at equal priority.
    order = sorted(seqs, key=lambda s: s.times.first_scheduled)
    assert [s.request_id for s in order] == [f"r{i}" for i in range(10)]


def test_lower_priority_value_admitted_first():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    spec = [("a", 5), ("b", 1), ("c", 3), ("d", 1), ("e", 0)]
    seqs = [make_seq(rid, 4, max_tokens=2, priority=p) for rid, p in spec]
    for s in seqs:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["e", "b", "d", "c", "a"]
    run_to_completion(sched)
    order = [s.request_id for s in sorted(seqs, key=lambda s: s.times.first_scheduled)]
    assert order == ["e", "b", "d", "c", "a"]


def test_higher_priority_request_preempts_lower_priority_running_one():
    # 6 blocks of 4 tokens; the watermark keeps 1 block free at admission.
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=32, max_prefill_chunk=32)
    low = make_seq("low", 16, max_tokens=4, priority=5)
    sched.add(low)
    step(sched)
    assert low.status is SequenceStatus.RUNNING and len(sched.tables["low"].blocks) == 4
    step(sched)  # one decode: 18 tokens, 5 blocks
    assert len(low.output_token_ids) == 2 and sched.pool.num_free == 1

    # An equally important request waits: it does not push the running one out.
    peer = make_seq("peer", 8, max_tokens=2, priority=5)
    sched.add(peer)
    out = step(sched)
    assert out.preempted == [] and peer.status is SequenceStatus.WAITING
    sched.finish(peer, FinishReason.ABORT)

    urgent = make_seq("urgent", 8, max_tokens=2, priority=0)
    sched.add(urgent)
    out = step(sched)
    assert out.preempted == [low], "the less important running request must give way"
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1
    assert low.num_computed_tokens == 0, "preemption by recompute resets the computed tokens"
    assert sched.tables["low"].blocks == [] and sched.pool.owners() <= {"urgent"}
    assert [c.seq.request_id for c in out.chunks] == ["urgent"], "the urgent request runs in the preempting step"
    assert sched.num_preemptions == 1

    produced = list(low.output_token_ids)
    run_to_completion(sched)
    assert urgent.times.finished < low.times.finished
    assert low.output_token_ids[: len(produced)] == produced and len(low.output_token_ids) == 4
    assert sched.pool.num_used == 0


def test_preemption_by_recompute_when_decodes_run_out_of_blocks():
    # Two sequences that each grow to 3 blocks share a 5-block pool: the later one must be preempted.
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64, max_num_seqs=4,
                           max_num_batched_tokens=32, max_prefill_chunk=32)
    first = make_seq("first", 4, max_tokens=8)
    second = make_seq("second", 4, max_tokens=8)
    sched.add(first)
    sched.add(second)
    outs = []
    while not outs or not outs[-1].preempted:
        outs.append(step(sched))
        assert len(outs) < 20
    assert outs[-1].preempted == [second], "the latest arrival is preempted first"
    assert second.num_computed_tokens == 0 and second.num_preemptions == 1 and second.output_token_ids
    assert "second" not in {c.seq.request_id for c in outs[-1].chunks}
    # When it comes back, it recomputes prompt + everything it produced, then samples its next token.
    produced = len(second.output_token_ids)
    while second.status is not SequenceStatus.RUNNING:
        step(sched)
    assert second.num_computed_tokens == second.num_prompt_tokens + produced
    assert len(second.output_token_ids) == produced + 1
    run_to_completion(sched)
    assert len(first.output_token_ids) == 8 and len(second.output_token_ids) == 8
    assert sched.pool.num_used == 0


def test_request_needing_the_whole_pool_is_admitted_when_alone():
    # check_fits accepts it (4 blocks <= 4), so the scheduler must be able to run it rather than wait forever.
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=1024)
    seq = make_seq("big", 60, max_tokens=4)
    sched.add(seq)
    run_to_completion(sched, max_steps=50)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.output_token_ids) == 4


# --- finish / abort -----------------------------------------------------------------------------------------------


def test_finish_frees_blocks_and_removes_from_queues():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    running = make_seq("running", 20, max_tokens=5)
    waiting = make_seq("waiting", 4, max_tokens=5)
    sched.add(running)
    sched.add(waiting)
    step(sched)
    assert running.status is SequenceStatus.RUNNING and sched.pool.num_used > 0
    assert sched.find("waiting") is waiting and sched.find("running") is running
    sched.finish(waiting, FinishReason.ABORT)
    assert sched.num_waiting == 0 and sched.find("waiting") is None
    sched.finish(running, FinishReason.ABORT)
    assert running.is_finished and running.finish_reason is FinishReason.ABORT
    assert running.times.finished is not None
    assert sched.pool.num_used == 0 and not sched.has_unfinished() and sched.tables == {}
    assert sched.schedule().is_empty


def test_vip_arrival_preempts_batch_work_at_the_sequence_cap():
    # Plenty of KV blocks: only the sequence cap stands between the VIP and a slot.
    sched = make_scheduler(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64)
    batch = [make_seq(f"batch{i}", 6, max_tokens=50, priority=5) for i in range(4)]
    for s in batch:
        sched.add(s)
    step(sched)
    step(sched)
    assert len(sched.running) == 4 and all(s.in_decode for s in batch)

    # An equally important arrival waits for a free slot: equal priorities never preempt each other.
    peer = make_seq("peer", 6, max_tokens=2, priority=5)
    sched.add(peer)
    for _ in range(3):
        out = step(sched)
        assert out.preempted == [] and peer.status is SequenceStatus.WAITING
    sched.finish(peer, FinishReason.ABORT)

    vip = make_seq("vip", 6, max_tokens=3, priority=0)
    sched.add(vip)
    out = step(sched)
    latest = max(batch, key=lambda s: s.arrival_time)
    assert out.preempted == [latest], "the least important, latest running sequence gives up its slot"
    assert vip.status is SequenceStatus.RUNNING and "vip" in {c.seq.request_id for c in out.chunks}
    assert latest.status is SequenceStatus.WAITING and latest.num_computed_tokens == 0
    assert len(sched.running) == 4
    # The preempted sequence does not take a slot back from the VIP, and gets it back once the VIP is done.
    while not vip.is_finished:
        out = step(sched)
        assert latest.status is SequenceStatus.WAITING or vip.is_finished
    run_to_completion(sched)
    assert latest.num_preemptions == 1 and len(latest.output_token_ids) == 50
    assert sched.pool.num_used == 0


def test_priority_tiers_at_the_cap_preempt_only_strictly_worse():
    sched = make_scheduler(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=32)
    mid = make_seq("mid", 4, max_tokens=20, priority=3)
    low = make_seq("low", 4, max_tokens=20, priority=5)
    sched.add(mid)
    sched.add(low)
    step(sched)
    other_mid = make_seq("mid2", 4, max_tokens=2, priority=3)
    sched.add(other_mid)
    out = step(sched)
    assert out.preempted == [low], "a better request preempts the worse one, never its equal"
    assert {s.request_id for s in sched.running} == {"mid", "mid2"}
    third_mid = make_seq("mid3", 4, max_tokens=2, priority=3)
    sched.add(third_mid)
    out = step(sched)
    assert out.preempted == [] and third_mid.status is SequenceStatus.WAITING
    run_to_completion(sched)
    assert sched.pool.num_used == 0


def test_background_cap_pauses_less_important_work_while_a_vip_runs():
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, max_background_seqs=1)
    batch = [make_seq(f"batch{i}", 6, max_tokens=40, priority=2) for i in range(3)]
    for s in batch:
        sched.add(s)
    step(sched)
    out = step(sched)
    assert len(out.decode_ids) == 3  # nobody more important: no cap
    vip = make_seq("vip", 6, max_tokens=4, priority=0)
    sched.add(vip)
    late = make_seq("late", 6, max_tokens=4, priority=2)
    sched.add(late)
    while not vip.is_finished:
        out = step(sched)
        ids = {c.seq.request_id for c in out.chunks}
        assert "vip" in ids
        assert len(ids - {"vip"}) == 1, "one less important sequence a step while the VIP runs"
        assert late.status is SequenceStatus.WAITING, "no new batch admission that would only pause"
    assert {s.request_id for s in batch if s.num_computed_tokens > 7} == {"batch0"}  # the earliest kept going
    out = step(sched)
    assert len(out.chunks) == 4  # the VIP is done: everyone runs again (and the late one is admitted)
    run_to_completion(sched)
    assert all(len(s.output_token_ids) == 40 for s in batch) and sched.pool.num_used == 0


def test_protected_priority_pauses_others_only_for_the_reserved_lane():
    """Set at run time (as the server does for the VIP lane): standard work leaves batch alone, a VIP pauses both."""
    sched = make_scheduler(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    sched.set_background(0, protected_priority=0)
    batch = [make_seq(f"batch{i}", 6, max_tokens=30, priority=2) for i in range(2)]
    standard = make_seq("std", 6, max_tokens=30, priority=1)
    for s in [*batch, standard]:
        sched.add(s)
    step(sched)
    out = step(sched)
    assert {c.seq.request_id for c in out.chunks} == {"batch0", "batch1", "std"}, "no VIP: nobody pauses"
    vip = make_seq("vip", 6, max_tokens=4, priority=0)
    sched.add(vip)
    while not vip.is_finished:
        out = step(sched)
        assert {c.seq.request_id for c in out.chunks} == {"vip"}, "with 0 background seqs the VIP runs alone"
    out = step(sched)
    assert {c.seq.request_id for c in out.chunks} == {"batch0", "batch1", "std"}
    sched.set_background(None)
    run_to_completion(sched)
    assert all(len(s.output_token_ids) == 30 for s in [*batch, standard]) and sched.pool.num_used == 0
    with pytest.raises(ValueError):
        sched.set_background(-1)
