"""Teacher-forced scoring of a text: per-token negative log-likelihood and top-1 predictions.

The fidelity of a weight format is judged by perplexity on a fixed text against float32 (free-running greedy agreement
flips on any near-tie and says little). Scoring goes through the engine's own paths: the prefix as one prefill chunk,
then every later token as a decode step, so the native format's whole-step decode kernel is what gets measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tailguard.engine.blocks import BlockTable
from tailguard.engine.scheduler import ScheduledChunk
from tailguard.engine.sequence import SamplingParams, Sequence


@dataclass
class TextScore:
    nll: list[float]  # -log p(token_i | tokens_<i) for each scored token
    top1: list[int]  # the model's most likely token at each scored position
    targets: list[int]

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))

    def top1_agreement(self, other: TextScore) -> float:
        return sum(a == b for a, b in zip(self.top1, other.top1)) / len(self.top1)


def score_text(engine, token_ids: list[int], prefix: int = 16, request_id: str = "score") -> TextScore:
    """Score ``token_ids[prefix:]`` given everything before each token, on an idle ``LLMEngine``."""
    if not 1 <= prefix < len(token_ids):
        raise ValueError("need at least one prefix token and one token to score")
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"text of {len(token_ids)} tokens is longer than the context ({engine.max_model_len})")
    runner = engine.runner
    table = BlockTable(engine.pool, request_id)
    if not table.ensure(len(token_ids)):
        raise RuntimeError("not enough free KV blocks to score this text")
    seq = Sequence(request_id=request_id, prompt_token_ids=list(token_ids[:prefix]), sampling=SamplingParams())
    nll: list[float] = []
    top1: list[int] = []
    try:
        chunk = ScheduledChunk(seq, 0, prefix)
        while True:
            row = runner.chunk_logits([chunk], {request_id: table})[0]
            if not isinstance(row, np.ndarray):  # the torch runner's tensor, on the CPU or CUDA
                row = row.float().cpu().numpy()
            logits = row.astype(np.float64)
            target = token_ids[seq.num_tokens]
            shifted = logits - logits.max()
            nll.append(float(np.log(np.exp(shifted).sum()) - shifted[target]))
            top1.append(int(logits.argmax()))
            seq.output_token_ids.append(target)
            if seq.num_tokens == len(token_ids):
                break
            chunk = ScheduledChunk(seq, seq.num_tokens - 1, 1)
    finally:
        table.release()
    return TextScore(nll, top1, list(token_ids[prefix:]))
