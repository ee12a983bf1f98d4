"""Choosing each new token from a step's logits, in numpy (the native runner's sampler; torch_runner.py has torch's).

The same rules as runner.ModelRunner.sample: greedy is the argmax; sampling applies temperature, then top-k, then
top-p (the smallest set of most likely tokens whose mass reaches top_p), and draws from what is left; stop tokens are
forbidden while a request is below its min_tokens; logprobs are log-softmax of the raw logits. A seeded request draws
from its own generator (numpy's PCG64), so its output repeats run after run; the torch runner draws from torch's
generator, so the same seed gives other tokens there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tailguard.engine.sequence import SamplingParams, Sequence


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
        if len(seq.output_token_ids) >= seq.sampling.min_tokens:
            return []
        return list(stop_ids | set(seq.sampling.stop_token_ids))

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
        masked = row
        if banned:
            masked = row.copy()
            masked[banned] = -np.inf
        sp = seq.sampling
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
