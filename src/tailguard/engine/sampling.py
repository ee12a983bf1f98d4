"""Choosing each new token from a step's logits, in numpy (the native runner's sampler; torch_runner.py has torch's).

The same rules as runner.ModelRunner.sample: greedy is the argmax; sampling applies temperature, then top-k, then
top-p (the smallest set of most likely tokens whose mass reaches top_p), and draws from what is left; stop tokens are
forbidden while a request is below its min_tokens; logprobs are log-softmax of the raw logits. Before any of that, a
request with penalties, a logit bias or a grammar has its row transformed by its LogitsState (below; the torch runner
applies the same code to its rows, so both runners pick the same tokens from the same logits). A seeded request draws
from its own generator (numpy's PCG64), so its output repeats run after run; the torch runner draws from torch's
generator, so the same seed gives other tokens there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tailguard.engine.sequence import SamplingParams, Sequence

if TYPE_CHECKING:
    from tailguard.engine.structured import GrammarMatcher


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # this row's sampling failed: its request alone ends with this error


def failed_row(exc: Exception) -> SampledToken:
    """The token of a row whose sampling raised: the engine ends that request alone (no neighbour is touched)."""
    return SampledToken(-1, error=f"sampling failed: {type(exc).__name__}: {str(exc)[:200]}")


def log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def probabilities(row: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """The distribution a sampled token is drawn from (float64, sums to one): temperature, top-k, then top-p."""
    row = row.astype(np.float64) / sp.temperature
    if sp.top_k and sp.top_k < row.shape[-1]:
        kth = np.partition(row, -sp.top_k)[-sp.top_k]
        row = np.where(row < kth, -np.inf, row)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        drop = np.cumsum(sorted_probs) - sorted_probs >= sp.top_p
        sorted_probs[drop] = 0.0
        probs = np.zeros_like(probs)
        probs[order] = sorted_probs
        probs /= probs.sum()
    return probs


def banned_tokens(seq: Sequence, stop_ids: set[int]) -> list[int]:
    """Tokens forbidden now: the stop tokens while the request is below its min_tokens."""
    if len(seq.output_token_ids) >= seq.sampling.min_tokens:
        return []
    return list(stop_ids | set(seq.sampling.stop_token_ids))


class LogitsState:
    """What one request does to its logits beyond temperature, top-k and top-p, in this order (vLLM's): the logit
    bias is added; the repetition penalty divides positive and multiplies negative logits of every token seen in the
    prompt or the output; the frequency and presence penalties subtract ``frequency * count + presence`` from every
    token generated so far; the grammar sets every token it does not allow to -inf. Then the min_tokens ban, except
    where the grammar allows nothing but a stop token (the grammar wins). All in float32 on a copy of the row.

    Built at admission only for a request that needs it (``SamplingParams.transforms_logits``); its counts follow the
    sequence's output, read incrementally at each step."""

    __slots__ = ("presence", "frequency", "repetition", "bias_ids", "bias_values", "matcher", "_counts", "_counted",
                 "_seen", "_seen_ids", "_prompt")

    def __init__(self, seq: Sequence, matcher: GrammarMatcher | None = None) -> None:
        sp = seq.sampling
        self.presence = float(sp.presence_penalty)
        self.frequency = float(sp.frequency_penalty)
        self.repetition = float(sp.repetition_penalty)
        self.bias_ids: np.ndarray | None = None
        self.bias_values: np.ndarray | None = None
        if sp.logit_bias:
            self.bias_ids = np.fromiter(sp.logit_bias.keys(), dtype=np.int64, count=len(sp.logit_bias))
            self.bias_values = np.fromiter(sp.logit_bias.values(), dtype=np.float32, count=len(sp.logit_bias))
        self.matcher = matcher
        self._counts: dict[int, int] = {}  # output token -> times generated
        self._counted = 0  # output tokens already in _counts
        self._prompt = seq.prompt_token_ids
        self._seen: set[int] | None = None  # prompt and output tokens (repetition penalty), built on first use
        self._seen_ids: np.ndarray | None = None

    def _catch_up(self, output: list[int]) -> None:
        if len(output) < self._counted:  # never in this engine (outputs only grow), but stay exact if it happens
            self._counts.clear()
            self._counted = 0
            self._seen = None
        if self.repetition != 1.0 and self._seen is None:
            self._seen = set(self._prompt)
            self._seen_ids = None
        counts, seen = self._counts, self._seen
        for tok in output[self._counted:]:
            counts[tok] = counts.get(tok, 0) + 1
            if seen is not None and tok not in seen:
                seen.add(tok)
                self._seen_ids = None
        self._counted = len(output)

    def process(self, row: np.ndarray, seq: Sequence, banned: list[int]) -> np.ndarray:
        """A transformed float32 copy of one row of logits. (The grammar's mask is taken first, into the copy: -inf
        stays -inf under every later step, so the result is the same as masking last, and cheaper.)"""
        if self.matcher is not None:
            allowed = self.matcher.allowed()
            n_allowed = int(np.count_nonzero(allowed))
            if n_allowed == 0:
                raise ValueError("the grammar allows no token here")
            if n_allowed <= allowed.shape[0] // 8:  # the usual case: copy the few allowed logits into -inf
                ids = np.flatnonzero(allowed)
                out = np.full(row.shape[0], -np.inf, dtype=np.float32)
                out[ids] = row[ids]
            else:  # inside free text most tokens are allowed: one branch-free pass
                out = np.where(allowed, row.astype(np.float32, copy=False), np.float32(-np.inf))
            # min_tokens bans stop tokens, unless the grammar allows nothing else (then the grammar is done)
            if banned and int(np.count_nonzero(allowed[banned])) < n_allowed:
                out[banned] = -np.inf
        else:
            out = np.array(row, dtype=np.float32)
            if banned:
                out[banned] = -np.inf
        return self._penalize(out, seq)

    def greedy_token(self, row: np.ndarray, seq: Sequence, banned: list[int]) -> int:
        """The argmax of ``process(row, seq, banned)``, without the grammar's full mask where it is not needed: the
        argmax of the row under bias, penalties and ban is the masked argmax whenever the grammar allows that token
        (numpy's argmax takes the first of equal values, masked or not), which one check of that token tells (~1 us
        against tens for a mask over the vocabulary). Only a refused token pays for the mask."""
        if self.matcher is not None:
            out = np.array(row, dtype=np.float32)
            if banned:
                out[banned] = -np.inf
            tok = int(self._penalize(out, seq).argmax())
            if self.matcher.allows(tok):
                return tok
        return int(self.process(row, seq, banned).argmax())

    def _penalize(self, out: np.ndarray, seq: Sequence) -> np.ndarray:
        """Bias, repetition, frequency and presence penalties, in place."""
        if self.bias_ids is not None:
            out[self.bias_ids] += self.bias_values
        if self.presence or self.frequency or self.repetition != 1.0:
            self._catch_up(seq.output_token_ids)
        if self.repetition != 1.0:
            if self._seen_ids is None:
                assert self._seen is not None  # built by _catch_up
                self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            ids = self._seen_ids
            values = out[ids]
            out[ids] = np.where(values > 0, values / np.float32(self.repetition), values * np.float32(self.repetition))
        if (self.presence or self.frequency) and self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            out[ids] -= np.float32(self.frequency) * counts + np.float32(self.presence)
        return out


class Sampler:
    def __init__(self) -> None:
        self._rngs: dict[str, np.random.Generator] = {}
        self._shared = np.random.default_rng()

    def _rng(self, seq: Sequence) -> np.random.Generator:
        if seq.sampling.seed is None:
            return self._shared
        rng = self._rngs.get(seq.request_id)
        if rng is None:
            rng = self._rngs[seq.request_id] = np.random.default_rng(seq.sampling.generator_seed)
        return rng

    @staticmethod
    def _banned(seq: Sequence, stop_ids: set[int]) -> list[int]:
        """Tokens forbidden now: the stop tokens while the request is below its min_tokens."""
        return banned_tokens(seq, stop_ids)

    def sample(self, logits: np.ndarray, seqs: list[Sequence], stop_ids: set[int]) -> list[SampledToken]:
        """One token for each row of ``logits`` [len(seqs), vocab]."""
        out = []
        for row, seq in zip(logits, seqs):
            try:
                out.append(self._sample_row(row, seq, stop_ids))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end its step's neighbours
                out.append(failed_row(exc))
        return out

    def _sample_row(self, row: np.ndarray, seq: Sequence, stop_ids: set[int]) -> SampledToken:
        banned = self._banned(seq, stop_ids)
        state = seq.logits_state
        sp = seq.sampling
        if state is not None and sp.greedy:  # penalties, a logit bias or a grammar (the ban included)
            tok = state.greedy_token(row, seq, banned)
        else:
            masked = row
            if state is not None:  # a transformed copy, the ban included
                masked = state.process(row, seq, banned)
            elif banned:
                masked = row.copy()
                masked[banned] = -np.inf
            if sp.greedy:
                tok = int(masked.argmax())
            else:
                probs = probabilities(masked, sp)
                cdf = np.cumsum(probs)
                tok = int(np.searchsorted(cdf, self._rng(seq).random() * cdf[-1], side="right"))
                if tok >= len(cdf) or probs[tok] == 0:  # a draw rounding onto the very top: the last possible token
                    tok = int(np.flatnonzero(probs)[-1])
        if sp.logprobs is None:
            return SampledToken(tok)
        logprobs = log_softmax(row.astype(np.float32))
        top: list[tuple[int, float]] = []
        if sp.logprobs:
            best = np.argpartition(-logprobs, sp.logprobs - 1)[: sp.logprobs]
            best = best[np.argsort(-logprobs[best], kind="stable")]
            top = [(int(i), float(logprobs[i])) for i in best]
        return SampledToken(tok, float(logprobs[tok]), top)

    def release(self, request_id: str) -> None:
        self._rngs.pop(request_id, None)
