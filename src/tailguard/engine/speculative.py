"""Speculative decoding: proposers that guess the next tokens cheaply, and the policy that decides who speculates.

A proposer guesses up to K tokens for a sequence; the target model then checks all of them in one forward pass (a
chunk of K+1 tokens: the pending token plus the guesses), keeps the longest accepted prefix and one token of its own
(torch_runner.py verifies, engine.py rolls the KV cache back). Greedy output is token for token what the engine produces
without speculation; sampled output keeps the target's distribution (rejection sampling, torch_runner.py).

The policy is adaptive: each request's acceptance is tracked as an EMA; a request that accepts little gets fewer
guesses, then none for a while (it re-probes later); and nobody speculates while many sequences run, because a step
that verifies guesses runs in torch instead of the one-call C decode step and a busy batch is compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tailguard.engine.blocks import BlockTable
from tailguard.engine.sequence import Sequence

if TYPE_CHECKING:
    from typing_extensions import TypeIs

SPECULATIVE_METHODS = ("off", "ngram", "self", "draft:PATH")


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` guesses of the tokens that follow ``token_ids`` (prompt + output so far)."""
        ...


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose what followed.

    No model at all; strong where output copies its input (JSON extraction, "repeat and fix", code edits) or repeats
    itself. Longer n-grams are tried first: a longer match is a more specific (more likely right) guess.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_lookback: int = 4096) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_lookback = max_lookback  # bounds the per-step scan on long contexts

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        n_tok = len(token_ids)
        if max_tokens <= 0 or n_tok < self.min_ngram + 1:
            return []
        lo = max(0, n_tok - self.max_lookback)
        last = token_ids[-1]
        # Ends (exclusive) of earlier occurrences of the last token, latest first; one pass in C-speed code. A match
        # may not be the suffix itself, so it ends at most one token before the context does.
        ends = [i + 1 for i in range(n_tok - 2, lo - 1, -1) if token_ids[i] == last]
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            suffix = token_ids[n_tok - n :]
            for end in ends:
                if end - n >= lo and token_ids[end - n : end] == suffix:
                    return token_ids[end : end + max_tokens]
        return []


class BatchProposer(Protocol):
    """A proposer that runs a model (drafting.py): guesses for all speculating sequences of a step at once, through
    their block tables (which already hold the guessed positions)."""

    def propose_batch(self, items: list[tuple[Sequence, int]], tables: dict[str, BlockTable]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


def is_batch_proposer(proposer: Proposer | BatchProposer) -> TypeIs[BatchProposer]:
    """The proposer runs a model over block tables (it has ``propose_batch``)."""
    return hasattr(proposer, "propose_batch")


def check_method(method: str) -> str:
    """``method`` if it names a proposer; a ValueError that lists them otherwise."""
    if method in ("off", "ngram", "self") or (method.startswith("draft:") and len(method) > len("draft:")):
        return method
    raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, not {method!r}")


def make_proposer(method: str) -> Proposer | None:
    """The model-free proposer for ``method`` (None for off and for the model-based ones, built by the engine)."""
    check_method(method)
    return NgramProposer() if method == "ngram" else None


@dataclass
class SpecState:
    """One request's speculation record: counts for the final event, and the EMA that drives its K."""

    proposed: int = 0
    accepted: int = 0
    # A new request starts just below FULL_K_ACCEPTANCE: K - 1 guesses at first, the full K once one verification
    # is mostly accepted, and a pause after a first verification that accepts nothing (what free text often does).
    ema: float = 0.55
    cooldown: int = 0  # decode steps left before a request with low acceptance probes again
    pauses: int = 0  # consecutive pauses: each failed probe doubles the next cooldown


class SpeculationPolicy:
    """Decides, per step and per request, how many tokens to propose (0 = a plain decode)."""

    # On this CPU a verification step of 2-5 rows costs about 1.5-1.7x a one-row decode step (the single-row product
    # reads the quantized blocks directly; several rows dequantize them first), 7-9 rows about 2.2x. With a per-token
    # acceptance a, K guesses yield (1 - a^(K+1)) / (1 - a) tokens a step: speculation pays above a ~ 0.45.
    EMA_WEIGHT = 0.3  # weight of the latest verification in the acceptance EMA
    FULL_K_ACCEPTANCE = 0.6  # at or above this EMA a request gets the full K; below, K shrinks in proportion
    PAUSE_ACCEPTANCE = 0.4  # below this a request stops speculating for COOLDOWN_STEPS decode steps
    COOLDOWN_STEPS = 16  # the first pause; doubled after each failed probe, up to MAX_COOLDOWN_STEPS
    MAX_COOLDOWN_STEPS = 256
    PROBE_EMA = 0.45  # EMA a request resumes with: one bad probe pauses it again

    def __init__(self, proposer: Proposer | BatchProposer, num_speculative_tokens: int, max_running: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if max_running < 1:
            raise ValueError("speculative_max_running must be at least 1")
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_running = max_running
        self.states: dict[str, SpecState] = {}
        self.total_proposed = 0
        self.total_accepted = 0
        self.num_verify_steps = 0

    def state(self, request_id: str) -> SpecState:
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = SpecState()
        return st

    def batch_speculates(self, num_running: int) -> bool:
        """Many streams make the step compute-bound: verifying guesses would then cost more than it saves."""
        return num_running <= self.max_running

    @property
    def batched(self) -> bool:
        """The proposer runs a model over block tables: the engine drafts for the whole step before scheduling."""
        return is_batch_proposer(self.proposer)

    def budget(self, seq: Sequence) -> int:
        """How many guesses a sequence about to decode one token gets this step (0: a plain decode)."""
        sp = seq.sampling
        if not sp.speculative or len(seq.output_token_ids) < sp.min_tokens:
            return 0  # opted out, or stop tokens are still banned (a per-position rule the verifier does not apply)
        st = self.state(seq.request_id)
        if st.cooldown > 0:
            st.cooldown -= 1
            if st.cooldown == 0:
                st.ema = self.PROBE_EMA
            return 0
        k = self.k if st.ema >= self.FULL_K_ACCEPTANCE else max(1, int(self.k * st.ema / self.FULL_K_ACCEPTANCE))
        # A verify step yields up to k + 1 tokens: never propose past max_tokens (nor, therefore, the context).
        return max(0, min(k, sp.max_tokens - len(seq.output_token_ids) - 1))

    def draft(self, seq: Sequence) -> list[int]:
        """Guesses of a model-free proposer for a sequence about to decode one token; [] for a plain decode."""
        k = self.budget(seq)
        if k <= 0:
            return []
        proposer = self.proposer
        assert not is_batch_proposer(proposer)  # the engine drafts with draft_batch for those
        return proposer.propose(seq.prompt_token_ids + seq.output_token_ids, k)

    def draft_batch(self, running: list[Sequence], tables: dict[str, BlockTable], spare_blocks: int) -> dict[str, list[int]]:
        """Guesses of a model-based proposer for every decoding sequence that speculates this step.

        The guessed positions' blocks are taken now (the draft writes K/V there), but only from blocks beyond
        ``spare_blocks``, which stay free for the step's plain decodes: guessing never preempts anybody."""
        items: list[tuple[Sequence, int]] = []
        for seq in running:
            if not seq.in_decode:
                continue
            k = self.budget(seq)
            if k <= 0:
                continue
            table = tables[seq.request_id]
            need = table.blocks_needed(seq.num_computed_tokens + 1 + k)
            if need and not table.pool.can_allocate(need + spare_blocks):
                continue
            table.ensure(seq.num_computed_tokens + 1 + k)
            items.append((seq, k))
        if not items:
            return {}
        proposer = self.proposer
        assert is_batch_proposer(proposer)  # the engine calls this only where ``batched``
        guesses = proposer.propose_batch(items, tables)
        return {seq.request_id: g for (seq, _), g in zip(items, guesses) if g}

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        st = self.state(request_id)
        st.proposed += proposed
        st.accepted += accepted
        self.total_proposed += proposed
        self.total_accepted += accepted
        self.num_verify_steps += 1
        st.ema = (1 - self.EMA_WEIGHT) * st.ema + self.EMA_WEIGHT * (accepted / proposed)
        if st.ema < self.PAUSE_ACCEPTANCE:
            st.cooldown = min(self.MAX_COOLDOWN_STEPS, self.COOLDOWN_STEPS << st.pauses)
            st.pauses += 1
        else:
            st.pauses = 0

    def forget(self, request_id: str) -> SpecState | None:
        if is_batch_proposer(self.proposer):  # ``batched``
            self.proposer.forget(request_id)
        return self.states.pop(request_id, None)
