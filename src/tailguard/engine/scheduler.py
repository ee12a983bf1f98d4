"""Iteration-level continuous batching under a per-step token budget (plain Python, no torch).

Each step the scheduler hands the runner a list of chunks, one per sequence: a decode step is a chunk of one token, a
prefill is cut into chunks so that a long prompt shares steps with running streams instead of freezing them. Running
sequences in decode go first (they cost one token each), then running prefills, then newly admitted requests, in
priority order (lower value first, then arrival). When the KV pool runs short, or every sequence slot is taken and a
strictly more important request waits, the lowest-priority, latest request is preempted: its blocks are freed and it
is recomputed later from its prompt plus the tokens it already produced.

With prefix caching on, a request being admitted first looks up its leading full blocks in the cache (by content
hash): those found join its block table as they are and count as computed, so its prefill starts after them (a
preempted request gets back what is still cached of its own KV the same way). Blocks become findable once full and
computed (after the step that filled them); a sequence only ever writes past its computed tokens, so a cached block is
never written again.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypedDict

from tailguard.engine.blocks import BlockPool, BlockTable
from tailguard.engine.prefix_cache import cacheable_prefix_blocks, sequence_block_hashes
from tailguard.engine.sequence import FinishReason, RequestError, Sequence, SequenceStatus
from tailguard.engine.step_cost import StepCostModel, StepShape, chunk_keys

# With a step time budget, a prompt that has waited this many budgets since it arrived lifts the budget (see
# SchedulerConfig.prompt_wait_guard_s). With a 0.1 s budget, single A/B runs (CHANGELOG.md, 2026-12-06): TTFT P99 641 ms at
# 6 req/s and 4.4 s at 9 with the guard, 811 ms and 6.4 s without it.
PROMPT_WAIT_GUARD_STEPS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget shared by decodes and prefill chunks
    max_prefill_chunk: int = 512  # longest prefill chunk one sequence may take in a step
    watermark: float = 0.01  # share of KV blocks kept free when admitting new requests
    # While a more important request runs or waits, at most this many less important sequences take a step; the
    # others pause (their KV kept) until it is done. On a CPU a step costs about in proportion to its batch, so this
    # is what keeps a VIP stream's pace near an idle server's while batch work shares the engine. None: no limit.
    max_background_seqs: int | None = None
    # With it set, the cap holds only while a sequence of this priority or a more important one runs or waits, and
    # pauses everything less important than it: the VIP lane pauses standard and batch work, while standard work
    # leaves batch alone. None: any more important sequence pauses the less important ones.
    protected_priority: int | None = None
    enable_prefix_caching: bool = True  # share the KV of identical leading blocks between requests
    # A step budget in time: while streams decode, prefill chunks are sized so that the step's predicted time (the
    # step cost model, fitted online) stays within this many seconds, the decoding streams' inter-token budget. With
    # no stream decoding, prefill takes the whole token budget. None: the token budget alone.
    step_time_budget_s: float | None = None
    # The least prompt tokens a step carries while prefills wait, whatever the time budget: prompts always progress.
    min_prefill_chunk: int = 16
    # The time budget yields while a prompt has waited longer than this since it arrived: past it, a queue of prompts
    # is building up (the budget caps how fast prompts go in), and their TTFT matters more than the decoding streams'
    # next gap, so prefill takes the token budget until the queue drains. A prompt part-way through its prefill that
    # needs more than one full chunk still counts from its last chunk instead: a long prompt that progresses every
    # step is no queue, and lifting the budget for it would stall every stream step after step (one request's prompt
    # must not do that). None: PROMPT_WAIT_GUARD_STEPS budgets.
    prompt_wait_guard_s: float | None = None
    # Within a priority, waiting requests are taken in the order of their arrival plus this many seconds per prompt
    # token still to compute: short prompts pass long ones that arrived less than that long before them, which cuts
    # the TTFT tail of a mixed load, and a long prompt is passed only by requests that arrive within its handicap
    # (so it never starves). 0: first come, first served.
    prompt_rank_s_per_token: float = 0.0
    # A prefill chunk may run past the step's token budget and the chunk cap by up to this many tokens (and at most
    # an eighth of the smaller of the two) when that finishes its prompt: a prompt a few tokens longer than the budget,
    # or than what decode rows leave of it, then takes one step instead of two, and the second would cost a step's
    # weight reads for a handful of tokens. A time budget still caps it. 0: chunks never pass the budget.
    prefill_overrun_tokens: int = 64

    @property
    def max_prefill_overrun(self) -> int:
        """The most tokens a prompt's last chunk may take past the token budget and the chunk cap."""
        return min(self.prefill_overrun_tokens, min(self.max_num_batched_tokens, self.max_prefill_chunk) // 8)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every decode fits in a step")
        if self.max_prefill_chunk < 1 or self.max_model_len < 2:
            raise ValueError("max_prefill_chunk and max_model_len must be positive")
        if self.max_background_seqs is not None and self.max_background_seqs < 0:
            raise ValueError("max_background_seqs must be >= 0 (or None: no limit)")
        if self.prefill_overrun_tokens < 0:
            raise ValueError("prefill_overrun_tokens must be >= 0")
        if self.prompt_rank_s_per_token < 0:
            raise ValueError("prompt_rank_s_per_token must be >= 0")
        if self.step_time_budget_s is not None and self.step_time_budget_s <= 0:
            raise ValueError("step_time_budget_s must be positive (or None: no time budget)")


class _PendingCaps(TypedDict, total=False):
    """SchedulerConfig fields changed at run time (set_caps, set_background), waiting for the next step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_background_seqs: int | None
    protected_priority: int | None


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed in this step (= tokens already in the KV cache)
    num_tokens: int  # including the draft's guessed tokens
    # Speculative guesses appended after the sequence's pending token: a verifying chunk computes the pending token
    # and every guess in one pass, and each of its positions yields a token (speculative.py).
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last position yields a new token."""
        return self.end - len(self.draft) == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0 and self.samples

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids_slice(self.start, self.end - len(self.draft)) + self.draft


def leading_decode_rows(chunks: list[ScheduledChunk]) -> int:
    """Rows of the decodes and verifications a step starts with (the scheduler puts them first): the one-call C step
    runs them through the block kernels and the rows after them as prompt rows."""
    rows = 0
    for chunk in chunks:
        if not (chunk.is_decode or chunk.draft):
            break
        rows += chunk.num_tokens
    return rows


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # the counts its time depends on (step_cost.py)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, clock=time.perf_counter) -> None:
        self.config = config
        self.pool = pool
        self.clock = clock
        self.running: list[Sequence] = []
        self._waiting: list[tuple[int, float, int, Sequence]] = []
        self._counter = itertools.count()
        self.tables: dict[str, BlockTable] = {}
        self._watermark_blocks = max(1, int(pool.num_blocks * config.watermark)) if pool.num_blocks > 1 else 0
        self.num_preemptions = 0
        # The step cost model behind a time budget and predict_ttft (fed by the engine with each step's measured time).
        self.cost = StepCostModel()
        self.step_shape: StepShape | None = None  # the last step scheduled (the one running, while one runs)
        self.step_running = False  # a step was scheduled and not yet advanced: its chunks are being computed
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache at admissions
        self.prefix_cache_hits = 0  # of which found there (not computed again)
        # Caps asked for at run time (a planner's thread): applied at the next step's start, never within a step.
        self._caps_lock = threading.Lock()
        self._pending: _PendingCaps = {}

    # --- run-time caps --------------------------------------------------------------------------------------------
    def set_caps(self, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> None:
        """Change the running-sequence cap (and the per-step token budget) from any thread; the next step applies
        it. A lower cap admits nobody until the running sequences drain below it: none is preempted for it."""
        budget = self.config.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        if not isinstance(max_num_seqs, int) or not isinstance(budget, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, not {max_num_seqs!r}")
        if budget < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs}) so every "
                             "decode fits in a step")
        with self._caps_lock:
            self._pending.update({"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget})

    def set_background(self, max_background_seqs: int | None, protected_priority: int | None = None) -> None:
        """Change the background cap (see SchedulerConfig) from any thread; the next step applies it."""
        if max_background_seqs is not None and (not isinstance(max_background_seqs, int) or max_background_seqs < 0):
            raise ValueError(f"max_background_seqs must be an integer >= 0 or None, not {max_background_seqs!r}")
        with self._caps_lock:
            self._pending.update({"max_background_seqs": max_background_seqs,
                                  "protected_priority": protected_priority})

    def _apply_pending_caps(self) -> None:
        with self._caps_lock:
            pending, self._pending = self._pending, {}
        if pending:
            self.config = dataclasses.replace(self.config, **pending)

    # --- admission ------------------------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestError for a request that could never be served, before it takes a place in the queue."""
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise RequestError("the prompt is empty")
        if num_prompt_tokens >= limit:
            raise RequestError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context window is {limit} tokens"
            )
        if num_prompt_tokens + max_tokens > limit:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {num_prompt_tokens + max_tokens} "
                f"exceeds the context window of {limit} tokens; lower max_tokens to at most {limit - num_prompt_tokens}"
            )
        need = self.pool.blocks_for(num_prompt_tokens + max_tokens)
        if need > self.pool.num_blocks:
            raise RequestError(
                f"the request needs {need} KV blocks at full length; the KV cache holds {self.pool.num_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt_tokens, seq.sampling.max_tokens)
        if seq.request_id in self.tables:
            raise RequestError(f"duplicate request id {seq.request_id!r}")
        self.tables[seq.request_id] = BlockTable(self.pool, seq.request_id)
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        rank = seq.arrival_time + self.config.prompt_rank_s_per_token * (seq.num_tokens - seq.num_computed_tokens)
        heapq.heappush(self._waiting, (seq.priority, rank, next(self._counter), seq))

    @property
    def waiting(self) -> list[Sequence]:
        return [entry[3] for entry in sorted(self._waiting)]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self._waiting)

    def predict_ttft(self, num_prompt_tokens: int, priority: int = 0, queued_ahead: Iterable[int] = ()) -> float:
        """Seconds from now until a prompt of ``num_prompt_tokens`` arriving now at ``priority`` would get its first
        token, by the step cost model: the prompt tokens ranked ahead of it (prefills in progress, waiting prompts
        of its priority or a more important one, and ``queued_ahead``: the lengths of such prompts submitted but not
        yet added, which the engine thread takes between steps) and its own go in budget-sized chunks beside today's
        decoding streams, each step costing what the model says, after half the step that runs now (on average a
        request arrives halfway through one; the prompt chunks that step computes are not counted again). The keys
        those prompt tokens attend to are each prompt's own, spread over the steps in proportion to their tokens
        (several short prompts in one step attend to far fewer keys than one long prompt would). What it leaves out:
        streams that start or end meanwhile. For knowing early that a request cannot meet a TTFT target (a lane's
        ``ttft_target_s``)."""
        decoding = [s for s in self.running if s.in_decode]
        rows, keys = len(decoding), sum(s.num_tokens for s in decoding)
        ahead = [(s.num_computed_tokens, s.num_pending_tokens) for s in self.running if not s.in_decode]
        ahead += [(item[-1].num_computed_tokens, item[-1].num_pending_tokens) for item in self._waiting
                  if item[-1].priority <= priority]
        ahead += [(0, n) for n in queued_ahead]
        ahead.append((0, num_prompt_tokens))
        total = sum(n for _, n in ahead)
        prompt_keys = sum(chunk_keys(start, n) for start, n in ahead)
        seconds = 0.0
        if self.step_running and self.step_shape is not None:
            # Half the step in progress is left; its prompt chunks (not yet advanced) are computed in it.
            shape = self.step_shape
            seconds = 0.5 * self.cost.predict(shape)
            total = max(num_prompt_tokens, total - shape.prefill_tokens)
            prompt_keys = max(chunk_keys(0, num_prompt_tokens), prompt_keys - shape.prefill_keys)
        per_step = max(1, min(self.config.max_num_batched_tokens - rows, self.config.max_prefill_chunk))
        full, last = divmod(total, per_step)
        for i in range(full + (last > 0)):
            n = per_step if i < full else last
            seconds += self.cost.predict(StepShape(rows, keys + rows * i, n, round(prompt_keys * n / total)))
        return seconds

    def _prompts_overdue(self, budget_s: float) -> bool:
        """A prompt still to compute is past the guard: waiting since it arrived, or part-way through its prefill
        since it arrived if one full chunk finishes it (the lifted step ends its TTFT), else since its last chunk (a
        long prompt that progresses every step keeps the budget: lifting it would stall every stream for step after
        step, and its own TTFT is long either way)."""
        guard = self.config.prompt_wait_guard_s
        if guard is None:
            guard = PROMPT_WAIT_GUARD_STEPS * budget_s
        oldest = now = self.clock()
        one_chunk = min(self.config.max_num_batched_tokens, self.config.max_prefill_chunk) + \
            self.config.max_prefill_overrun
        for seq in self.running:
            if not seq.in_decode:
                progressing = seq.prefill_progress_at is not None and seq.num_pending_tokens > one_chunk
                oldest = min(oldest, seq.prefill_progress_at if progressing else seq.arrival_time)
        for item in self._waiting:
            seq = item[-1]
            if seq.arrival_time < oldest:
                oldest = seq.arrival_time
        return now - oldest > guard

    # --- the step -------------------------------------------------------------------------------------------------
    def schedule(self, draft_for: Callable[[Sequence], list[int]] | None = None) -> SchedulerOutput:
        """Plan one step. ``draft_for`` (speculative decoding) gives guesses for a sequence about to decode; they are
        verified in its chunk when budget and KV blocks allow, never at the cost of another sequence's decode."""
        self._apply_pending_caps()  # the step boundary: caps change between steps only
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk_of: dict[str, ScheduledChunk] = {}
        budget_s = self.config.step_time_budget_s
        if budget_s is not None and self._prompts_overdue(budget_s):
            budget_s = None  # a prompt queue is building: prefill at full speed until it drains
        overrun = self.config.max_prefill_overrun
        counts = [0, 0, 0, 0]  # decode rows, their keys, prefill tokens, their keys: the step's shape so far

        added: dict[str, tuple[int, int, int, int]] = {}

        def count(seq: Sequence, start: int, n: int, sign: int = 1) -> None:
            part = (n, n * (start + n), 0, 0) if seq.in_decode else (0, 0, n, chunk_keys(start, n))
            if sign > 0:
                added[seq.request_id] = part
            else:
                part = added.pop(seq.request_id, (0, 0, 0, 0))
            for i, v in enumerate(part):
                counts[i] += sign * v

        def time_cap(start: int, n: int) -> int:
            """How much of an ``n``-token prefill chunk from ``start`` the step's time budget leaves room for: all of
            it while no stream decodes (nobody waits on the step), else what keeps the predicted step time within
            the budget, and at least ``min_prefill_chunk`` for the step's first prefill so that prompts progress."""
            if budget_s is None or counts[0] == 0:
                return n
            room = self.cost.prefill_room(StepShape(*counts), budget_s, start, n)
            if room == 0 and counts[2] == 0:
                room = min(n, self.config.min_prefill_chunk)
            return room

        def prefill_size(remaining: int) -> int:
            """A prefill chunk's size before the time budget: what the token budget and chunk cap allow, or the
            whole rest of the prompt when that is at most ``max_prefill_overrun`` more."""
            n = min(remaining, budget, self.config.max_prefill_chunk)
            return remaining if remaining - n <= overrun else n

        def preempt(victim: Sequence) -> None:
            nonlocal budget
            dropped = chunk_of.pop(victim.request_id, None)
            if dropped is not None:
                out.chunks.remove(dropped)
                budget += dropped.num_tokens
                count(victim, dropped.start, dropped.num_tokens, -1)
            self._preempt(victim)
            out.preempted.append(victim)

        def victim_for(seq: Sequence, candidates: list[Sequence]) -> Sequence | None:
            pool = [s for s in candidates if s.status is SequenceStatus.RUNNING]
            return max(pool, key=lambda s: (s.priority, s.arrival_time), default=None)

        cap = self.config.max_background_seqs
        top = min([s.priority for s in self.running] + ([self._waiting[0][0]] if self._waiting else []), default=0)
        protected = self.config.protected_priority
        if protected is not None:  # the cap holds only while a protected sequence is present, above its priority
            cap = cap if top <= protected else None
            top = protected
        background = 0

        def paused(seq: Sequence) -> bool:
            """A less important sequence beyond the background cap sits this step out."""
            nonlocal background
            if cap is None or seq.priority <= top:
                return False
            if background >= cap:
                return True
            background += 1
            return False

        # 1. Running sequences: decodes first so that prefill never starves streams, then unfinished prefills.
        decodes_left = sum(s.in_decode for s in self.running)
        for seq in sorted(self.running, key=lambda s: (not s.in_decode, s.priority, s.arrival_time)):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            if paused(seq):
                decodes_left -= seq.in_decode
                continue
            n = min(seq.num_pending_tokens, budget, self.config.max_prefill_chunk)
            if not seq.in_decode and n > 0:
                n = time_cap(seq.num_computed_tokens, prefill_size(seq.num_pending_tokens))
                if n <= 0:
                    continue
            table = self.tables[seq.request_id]
            draft: list[int] = []
            if seq.in_decode:
                decodes_left -= 1
                if draft_for is not None:
                    # Guesses take only budget no later decode needs, and only blocks the pool has free now.
                    room = min(budget - 1 - decodes_left, self.config.max_prefill_chunk - 1)
                    draft = draft_for(seq)[:room] if room > 0 else []
                    if draft and not table.ensure(seq.num_computed_tokens + 1 + len(draft)):
                        draft = []
                    n += len(draft)
            while not table.ensure(seq.num_computed_tokens + n):
                victim = victim_for(seq, self.running)
                assert victim is not None  # seq itself is running: there is always one
                preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, n, draft)
            out.chunks.append(chunk)
            chunk_of[seq.request_id] = chunk
            budget -= n
            count(seq, chunk.start, n)

        # 2. Admit waiting requests while budget, sequence slots and KV blocks (above the watermark) allow.
        # No admission in a step where running sequences already ran short of blocks. A preemption made below, for a
        # more important request (KV blocks or sequence slots), does not stop the loop: that request is retried (and admitted) in this same step.
        running_short = bool(out.preempted)
        while self._waiting and budget > 0 and not running_short:
            seq = self._waiting[0][3]
            if any(seq is p for p in out.preempted):
                break  # just pushed out to make room; it does not come straight back
            if len(self.running) > self.config.max_num_seqs:
                break  # the cap was lowered under running sequences: they finish, nobody is preempted for it
            if len(self.running) >= self.config.max_num_seqs:
                # Every sequence slot is taken: a strictly more important request takes the slot of the least
                # important, latest running one (otherwise a VIP waits behind batch work for a whole generation).
                victim = victim_for(seq, self.running)
                if victim is None or victim.priority <= seq.priority:
                    break
                preempt(victim)
                continue
            if cap is not None and seq.priority > top and background >= cap:
                break  # it would only pause: leave it waiting (its blocks stay free)
            table = self.tables[seq.request_id]
            hits = self._cached_prefix(seq, table)
            start = len(hits) * self.pool.block_size
            n = time_cap(start, prefill_size(seq.num_tokens - start))
            if n <= 0:
                break  # the step's time is spent: it waits for the next one
            # Cached blocks nobody holds sit in the free list: taking them uses up free capacity too.
            need = self.pool.blocks_for(start + n) - len(hits) + self.pool.num_unreferenced(hits)
            # The watermark keeps room for running sequences to grow; with none running, a request that check_fits
            # accepted (it fits the whole pool) must be admissible, or it would wait forever.
            watermark = self._watermark_blocks if self.running else 0
            if not self.pool.can_allocate(need + watermark):
                # A more important request may take the place of a less important running one.
                victim = victim_for(seq, self.running)
                if victim is None or victim.priority <= seq.priority:
                    break
                preempt(victim)
                continue
            heapq.heappop(self._waiting)
            if cap is not None and seq.priority > top:
                background += 1
            if self.config.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += start
                if seq.times.first_scheduled is None:
                    seq.num_cached_tokens = start
            if hits:
                table.attach_cached(hits)
                seq.num_computed_tokens = start
            table.ensure(seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = self.clock()
            chunk = ScheduledChunk(seq, seq.num_computed_tokens, n)
            out.chunks.append(chunk)
            chunk_of[seq.request_id] = chunk
            budget -= n
            count(seq, chunk.start, n)

        # The runner wants decodes first (one token each, or K+1 rows for a verifying chunk), then prefill chunks.
        out.chunks.sort(key=lambda c: not (c.is_decode or c.draft))
        out.shape = self.step_shape = StepShape(*counts)
        self.step_running = bool(out.chunks)
        return out

    def _cached_prefix(self, seq: Sequence, table: BlockTable) -> list[int]:
        """Cached blocks holding a waiting request's leading tokens (empty with prefix caching off)."""
        if not self.config.enable_prefix_caching or table.blocks or seq.num_computed_tokens:
            return []
        limit = cacheable_prefix_blocks(seq.num_tokens, self.pool.block_size)
        if limit == 0:
            return []
        return self.pool.lookup(sequence_block_hashes(seq, self.pool.block_size, limit))

    def _cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are now full and computed, so later requests can share them."""
        if not self.config.enable_prefix_caching or seq.status is not SequenceStatus.RUNNING:
            return
        table = self.tables.get(seq.request_id)
        if table is None:
            return
        full = min(seq.num_computed_tokens // self.pool.block_size, len(table.blocks))
        if full <= table.num_cached:
            return
        hashes = sequence_block_hashes(seq, self.pool.block_size, full)
        for i in range(table.num_cached, full):
            self.pool.register(table.blocks[i], hashes[i])
        table.num_cached = full

    def _preempt(self, seq: Sequence) -> None:
        self.tables[seq.request_id].release()
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)

    # --- after the step -------------------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> None:
        now = self.clock()
        for chunk in out.chunks:
            if not (chunk.is_decode or chunk.draft):
                # its prefill progressed, as of the step's end: a slow step does not make it look stalled
                chunk.seq.prefill_progress_at = now
            # A verifying chunk's KV is valid up to its pending token and the guesses that were accepted; the engine
            # rolls it back (roll_back) once it knows how many. Until then, only the pending token counts.
            chunk.seq.num_computed_tokens = chunk.end - len(chunk.draft)
            self._cache_computed_blocks(chunk.seq)
        self.step_running = False

    def roll_back(self, seq: Sequence, num_accepted: int) -> None:
        """Keep the KV of ``num_accepted`` verified guesses; positions past them are never read again (attention
        masks stop at each sequence's length) and blocks no longer needed go back to the pool."""
        seq.num_computed_tokens += num_accepted
        table = self.tables.get(seq.request_id)
        if table is not None and seq.status is SequenceStatus.RUNNING:
            table.trim(seq.num_tokens)
            self._cache_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        table = self.tables.pop(seq.request_id, None)
        if table is not None:
            table.release()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self._waiting = [e for e in self._waiting if e[3] is not seq]
            heapq.heapify(self._waiting)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.times.finished = self.clock()

    def find(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for entry in self._waiting:
            if entry[3].request_id == request_id:
                return entry[3]
        return None
