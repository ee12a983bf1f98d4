"""A fake engine with the AsyncLLMEngine interface and scripted timings.

It lets the server, gateway, SLO monitor and bench be tested deterministically without a model: time to first token,
inter-token gaps, jitter and concurrency slots are set by the test (and may be changed while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import random
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from tailguard.engine.engine import EngineStats, TokenEvent, _stop_prefix_overlap
from tailguard.engine.sequence import FinishReason, RequestError, SamplingParams


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 3..258) plus three specials; a ChatML-like template. Deterministic and model-free."""

    BOS, EOS, IM_END = 0, 1, 2
    _OFFSET = 3

    def __init__(self) -> None:
        self.vocab_size = 256 + self._OFFSET
        self.eos_token_id = self.EOS
        self.stop_token_ids = {self.EOS, self.IM_END}
        self.special_ids = {self.BOS, self.EOS, self.IM_END}
        self.max_token_chars = 1  # a token is one byte: never more than one character

    def min_tokens(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))  # exactly: one token a byte

    def encode(self, text: str) -> list[int]:
        return [b + self._OFFSET for b in text.encode("utf-8")]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - self._OFFSET for i in ids if i >= self._OFFSET).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))


@dataclass
class FakeTiming:
    ttft: float = 0.02  # seconds from scheduling to the first token (the "prefill")
    itl: float = 0.005  # seconds between tokens
    jitter: float = 0.0  # uniform +- fraction applied to every wait
    prefill_per_token: float = 0.0  # extra prefill seconds per prompt token
    max_num_seqs: int = 256  # concurrency slots; more requests queue
    output_text: str = "The quick brown fox jumps over the lazy dog. "
    seed: int = 0
    # Scripted speculative decoding counts on the final event: guesses per output token, and the accepted share.
    spec_proposed_per_token: float = 0.0
    spec_acceptance: float = 0.0
    # A batch's cost, as a real engine's step time grows with it: each decode gap is ``itl`` plus this much per other
    # running sequence (a replica that serves more streams serves each one slower).
    itl_per_running: float = 0.0
    # Waiting requests take a free slot most important first (the lowest priority value, as the real engine and
    # vLLM order them; FIFO within a priority), as an engine with priority scheduling does; False: first come,
    # first served.
    priority_scheduling: bool = False


class _Slots:
    """Concurrency slots handed out lowest priority value first, then in arrival order (a semaphore with a queue)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = 0

    async def acquire(self, priority: int = 0) -> bool:
        if self.free > 0 and not self._queue:
            self.free -= 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._order += 1
        entry = (priority, self._order, fut)
        heapq.heappush(self._queue, entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot came just as the wait was cancelled: hand it on
                self.release()
            else:
                self._queue.remove(entry)
                heapq.heapify(self._queue)
            raise
        return True

    def release(self) -> None:
        while self._queue:
            _, _, fut = heapq.heappop(self._queue)
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class FakeEngine:
    def __init__(self, timing: FakeTiming | None = None, max_model_len: int = 8192, model_name: str = "fake") -> None:
        self.timing = timing or FakeTiming()
        self.tokenizer = ByteTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._slots: _Slots | None = None
        self._rng = random.Random(self.timing.seed)
        self.running = 0
        self.waiting = 0
        self.aborted: list[str] = []
        self.completed = 0
        self._abort_flags: dict[str, asyncio.Event] = {}
        # What predict_ttft plays forward: waiting requests (priority, order, prompt tokens, max_tokens) and when each
        # running one is due to end by the script.
        self._queued: dict[str, tuple[int, int, int, int]] = {}
        self._ends: dict[str, float] = {}
        self._order = 0

    def check_request(self, num_prompt_tokens: int, sampling: SamplingParams) -> None:
        sampling.validate()
        if num_prompt_tokens < 1:
            raise RequestError("the prompt is empty")
        if num_prompt_tokens + sampling.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds the context window "
                f"of {self.max_model_len} tokens"
            )

    def _wait(self, base: float) -> float:
        j = self.timing.jitter
        return max(0.0, base * (1 + self._rng.uniform(-j, j))) if j else base

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        self.check_request(len(prompt_token_ids), sampling)
        if self._slots is None:
            self._slots = _Slots(self.timing.max_num_seqs)
        arrival = arrival_time if arrival_time is not None else time.perf_counter()
        text = self.timing.output_text.encode("utf-8")
        finished = False
        flag = self._abort_flags[request_id] = asyncio.Event()
        scheduled = first = None
        out: list[int] = []

        def aborted_event() -> TokenEvent:
            # Like the real engine: an abort ends the stream with a final event saying where the request was.
            return TokenEvent(request_id, None, "", time.perf_counter(), finished=True,
                              finish_reason=FinishReason.ABORT, num_prompt_tokens=len(prompt_token_ids),
                              num_output_tokens=len(out), arrival=arrival, first_scheduled=scheduled,
                              first_token=first)

        self.waiting += 1
        self._order += 1
        self._queued[request_id] = (priority, self._order, len(prompt_token_ids), sampling.max_tokens)
        try:
            if not await self._until_abort(self._slots.acquire(priority if self.timing.priority_scheduling else 0),
                                           flag):
                self._abort_flags.pop(request_id, None)
                self.aborted.append(request_id)
                yield aborted_event()
                return
        finally:
            self.waiting -= 1
            self._queued.pop(request_id, None)
        self.running += 1
        try:
            scheduled = time.perf_counter()
            self._ends[request_id] = scheduled + self._duration(len(prompt_token_ids), sampling.max_tokens)
            prefill = self._wait(self.timing.ttft + self.timing.prefill_per_token * len(prompt_token_ids))
            if not await self._until_abort(asyncio.sleep(prefill), flag):
                yield aborted_event()
                return
            emitted = 0  # characters of the decoded output already sent
            for i in range(sampling.max_tokens):
                gap = self.timing.itl + self.timing.itl_per_running * (self.running - 1)
                if i and not await self._until_abort(asyncio.sleep(self._wait(gap)), flag):
                    yield aborted_event()
                    return
                tok = text[i % len(text)] + ByteTokenizer._OFFSET
                out.append(tok)
                now = time.perf_counter()
                first = first or now
                full = self.tokenizer.decode(out)
                # Text rules of the real engine: the stop string is cut from the text, a tail that could still grow
                # into one is held back, and so is half a UTF-8 character.
                reason = None
                cut = len(full)
                hits = [full.find(s) for s in sampling.stop if s in full]
                if hits:
                    reason, cut = FinishReason.STOP, min(hits)
                elif len(out) >= sampling.max_tokens:
                    reason = FinishReason.LENGTH
                else:
                    cut = len(full.rstrip("\ufffd"))
                    cut -= _stop_prefix_overlap(full[:cut], sampling.stop) if sampling.stop else 0
                delta = full[emitted:max(cut, emitted)]
                emitted = max(cut, emitted)
                if reason is None:
                    yield TokenEvent(request_id, tok, delta, now)
                    continue
                finished = True
                self.completed += 1
                yield TokenEvent(
                    request_id, tok, delta, now, finished=True, finish_reason=reason,
                    num_prompt_tokens=len(prompt_token_ids), num_output_tokens=len(out),
                    arrival=arrival, first_scheduled=scheduled, first_token=first,
                    num_spec_proposed=round(len(out) * self.timing.spec_proposed_per_token),
                    num_spec_accepted=round(len(out) * self.timing.spec_proposed_per_token * self.timing.spec_acceptance),
                )
                return
        finally:
            self._abort_flags.pop(request_id, None)
            self._ends.pop(request_id, None)
            self.running -= 1
            self._slots.release()
            if not finished:
                self.aborted.append(request_id)

    def _duration(self, num_prompt_tokens: int, max_tokens: int) -> float:
        """A request's time in its slot by the script, without jitter: its prefill, then a gap per further token."""
        t = self.timing
        return t.ttft + t.prefill_per_token * num_prompt_tokens + t.itl * (max_tokens - 1)

    def predict_ttft(self, num_prompt_tokens: int, priority: int = 0) -> float:
        """The script played forward: the requests queued ahead of this one (every waiting one, or with
        ``priority_scheduling`` those of its priority or a more important one) each take the next slot to come free,
        running ones free theirs when their script says (max_tokens reached, no early stop), then its own prefill."""
        t = self.timing
        now = time.perf_counter()
        free_at = [now] * max(0, t.max_num_seqs - len(self._ends)) + [max(now, e) for e in self._ends.values()]
        heapq.heapify(free_at)

        ahead = [e for e in self._queued.values() if not t.priority_scheduling or e[0] <= priority]
        ahead.sort(key=lambda e: (e[0], e[1]) if t.priority_scheduling else e[1])  # the slots' own order
        for entry in ahead:
            start = heapq.heappop(free_at)
            heapq.heappush(free_at, start + self._duration(entry[2], entry[3]))
        start = heapq.heappop(free_at)
        return start - now + t.ttft + t.prefill_per_token * num_prompt_tokens

    @staticmethod
    async def _until_abort(work, flag: asyncio.Event) -> bool:
        """Run ``work`` unless the request is aborted first; True when the work completed."""
        if flag.is_set():
            work.close()
            return False
        task = asyncio.ensure_future(work)
        waiter = asyncio.ensure_future(flag.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False

    def abort(self, request_id: str) -> None:
        """End a request's stream with a final ``abort`` event (as the real engine does)."""
        flag = self._abort_flags.get(request_id)
        if flag is not None:
            flag.set()

    error: BaseException | None = None  # a scripted engine never dies
    speculates = False

    @property
    def max_num_seqs(self) -> int:
        return self.timing.max_num_seqs

    def protect_priority(self, max_background_seqs: int, protected_priority: int) -> None:
        """The scripted engine runs every request alike: nothing to pause."""

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running, waiting=self.waiting, kv_blocks_total=0, kv_blocks_used=0,
                           num_preemptions=0, steps=0)

    def shutdown(self) -> None:
        pass
