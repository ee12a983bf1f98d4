"""Model-based proposers for speculative decoding: a self-draft (the target's first layers) and a separate draft model.

Both guess greedily, one position at a time, for every speculating sequence of a step at once (batched rows), and
write their K/V through the sequence's own block table, so the blocks the verification step uses are the ones the
draft used (the engine reserves them before drafting):

- **self**: the first k layers of the target (k chosen so that they hold about a quarter of the layer parameters, the
  advised size) read out through the target's final norm and a head of their own: the target's output matrix cut to
  the most frequent tokens (BPE ids are merge-ordered, so low ids are the common tokens; the full 49,152-row head
  reads as many bytes as 13 layers). Without a trained head this early exit guesses poorly on SmolLM2-135M (about 3%
  of guesses accepted at k = 8 of 30 layers, 25% at 24; docs/speculative.md): the adaptive policy then pauses it.
  A least-squares refit of the final norm for layer k was tried and accepted fewer guesses. The draft needs no KV
  cache of its own: layers 0..k-1 of the target's cache already hold every position the target computed, and the positions the draft
  writes past them are rewritten by the verification (same tokens, same layers) or rolled back.
- **draft:PATH**: a smaller model with the same tokenizer, with its own KV cache over the same block ids. It catches
  up on positions it has not seen (the prompt, the target's bonus tokens) before guessing.

The verification makes the output exact whatever the draft guesses (torch_runner.py); a draft only changes speed.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import torch

from tailguard.engine.blocks import BlockTable
from tailguard.engine.kernels import GROUP_ROWS, INTERLEAVED_FORMATS, PackedMatrix
from tailguard.engine.loader import load_gguf
from tailguard.engine.scheduler import ScheduledChunk
from tailguard.engine.sequence import Sequence
from tailguard.engine.torch_model import Linear, LlamaModel
from tailguard.engine.torch_runner import ModelRunner

# Share of the target's layer parameters the self-draft keeps (the recommended draft: about 1/4 of the target).
SELF_DRAFT_LAYER_SHARE = 0.25
# Output rows the self-draft's head keeps: a third of the full head's cost; the measured acceptance was no lower
# than with all 49,152 rows (benchmarks/speculative.py's prompts).
SELF_DRAFT_VOCAB = 16384
# At most this many positions of catch-up per step (a draft model meeting a long prompt): bounded step time.
MAX_CATCH_UP_TOKENS = 512


def self_draft_layers(num_layers: int) -> int:
    return max(1, min(num_layers - 1, round(num_layers * SELF_DRAFT_LAYER_SHARE)))


def _truncated(model: LlamaModel, num_layers: int, norm: torch.Tensor, head) -> LlamaModel:
    """A view of ``model`` running only its first ``num_layers`` layers, with another final norm and head."""
    out = copy.copy(model)
    out.layers = model.layers[:num_layers]
    out.config = dataclasses.replace(model.config, num_layers=num_layers)
    out.norm = norm
    out.lm_head = head
    out._decode_step = None  # the copy binds its own C decode step (fewer layers, its own head)
    out._decode_step_cache = None
    return out


def _head_rows(head: Linear, rows: int) -> Linear:
    """The first ``rows`` output rows of a head, in its own weight format."""
    if head.packed is not None:
        p = head.packed
        if p.fmt in INTERLEAVED_FORMATS:  # stored in whole groups of 16 rows: keep whole groups
            rows = max(GROUP_ROWS, rows - rows % GROUP_ROWS)
        return Linear(PackedMatrix(np.ascontiguousarray(p.array[:rows]), p.fmt, rows, p.in_features), head.fmt)
    out = copy.copy(head)
    out.out_features = rows
    if head.weight is not None:
        out.weight = head.weight[:rows]
    else:  # int8
        out._qweight = head._qweight[:rows]
        out._wscale = head._wscale[:rows]
    return out


class DraftProposer:
    """Guesses from a draft model run over block tables (see the module docstring)."""

    def __init__(self, runner: ModelRunner, shares_target_kv: bool) -> None:
        self.runner = runner
        self.shares_target_kv = shares_target_kv
        # Draft model: per request, the tokens whose K/V its cache holds (positions 0..len-1), how many of those are
        # known committed, and the block ids they were written through (a preemption changes them).
        self._seen: dict[str, tuple[list[int], int, list[int]]] = {}

    @staticmethod
    def _tokens(logits: torch.Tensor) -> list[int]:
        return logits.argmax(dim=-1).tolist()  # a cut head keeps the first rows: row index = token id

    def _valid(self, seq: Sequence, table: BlockTable, tokens: list[int]) -> int:
        """Positions at the start of the sequence whose draft K/V is still right."""
        if self.shares_target_kv:
            return seq.num_computed_tokens  # the target's own layers computed them
        seen = self._seen.get(seq.request_id)
        if seen is None:
            return 0
        fed, confirmed, blocks = seen
        same_blocks = 0
        while same_blocks < min(len(blocks), len(table.blocks)) and blocks[same_blocks] == table.blocks[same_blocks]:
            same_blocks += 1
        limit = min(len(fed), seq.num_computed_tokens, same_blocks * self.runner.block_size)
        i = min(confirmed, limit)
        while i < limit and fed[i] == tokens[i]:
            i += 1
        return i

    def propose_batch(self, items: list[tuple[Sequence, int]], tables: dict[str, BlockTable]) -> list[list[int]]:
        """Up to k guesses for each (decoding sequence, k); its block table already holds positions through
        num_computed_tokens + k."""
        guesses: list[list[int]] = [[] for _ in items]
        chunks: list[ScheduledChunk] = []
        active: list[int] = []
        contexts: list[list[int]] = []
        for i, (seq, _k) in enumerate(items):
            tokens = seq.prompt_token_ids + seq.output_token_ids
            contexts.append(tokens)
            valid = self._valid(seq, tables[seq.request_id], tokens)
            start = max(valid, seq.num_computed_tokens + 1 - MAX_CATCH_UP_TOKENS)
            if start > valid:
                # Too far behind for one step: catch up on the oldest part now, guess on a later step.
                chunks.append(ScheduledChunk(seq, valid, MAX_CATCH_UP_TOKENS))
                self._remember(seq, tables[seq.request_id], tokens[: valid + MAX_CATCH_UP_TOKENS], valid)
                continue
            chunks.append(ScheduledChunk(seq, valid, seq.num_computed_tokens + 1 - valid))
            active.append(i)
        if not chunks:
            return guesses
        chunks.sort(key=lambda c: not c.is_decode)  # the runner's order: decodes first
        logits = self.runner.chunk_logits(chunks, tables)
        # Only chunks reaching the pending token sample; map their logits rows back to items.
        sampled = {c.seq.request_id: r for r, c in enumerate(c for c in chunks if c.samples)}
        first = self._tokens(logits)
        for i in active:
            guesses[i].append(first[sampled[items[i][0].request_id]])
        width = max((items[i][1] for i in active), default=0)
        for j in range(1, width):
            rows = [i for i in active if items[i][1] > j]
            if not rows:
                break
            tabs = [tables[items[i][0].request_id] for i in rows]
            positions = [items[i][0].num_computed_tokens + j for i in rows]
            out = self._tokens(self.runner.decode_rows([guesses[i][-1] for i in rows], positions, tabs))
            for i, tok in zip(rows, out):
                guesses[i].append(tok)
        for i in active:
            seq, k = items[i]
            # Fed: the committed tokens through the pending one, then every guess but the last.
            self._remember(seq, tables[seq.request_id], contexts[i][: seq.num_computed_tokens + 1] + guesses[i][:-1],
                           seq.num_computed_tokens + 1)
        return guesses

    def _remember(self, seq: Sequence, table: BlockTable, fed: list[int], confirmed: int) -> None:
        if not self.shares_target_kv:
            self._seen[seq.request_id] = (fed, confirmed, list(table.blocks))

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


def make_self_draft(target: ModelRunner, num_layers: int | None = None,
                    vocab_rows: int | None = None) -> DraftProposer:
    model = target.model
    k = num_layers or self_draft_layers(model.config.num_layers)
    rows = min(vocab_rows or SELF_DRAFT_VOCAB, model.lm_head.out_features)
    draft = _truncated(model, k, model.norm, _head_rows(model.lm_head, rows))
    # kv_cache[:k] is a contiguous view of the target's first k layers; kept as one object so the C step binds once.
    runner = ModelRunner(draft, 0, target.block_size, kv_cache=target.kv_cache[:k])
    return DraftProposer(runner, shares_target_kv=True)


def make_draft_model(path: str | Path, target: ModelRunner, tokenizer, num_blocks: int) -> DraftProposer:
    from tailguard.engine.model_store import resolve_model_path
    from tailguard.engine.tokenizer import GGUFTokenizer

    path = resolve_model_path(str(path))  # a .gguf path or a model alias
    draft_tok = GGUFTokenizer(path)
    probe = "Hello, world! 你好 {\"a\": 1}"
    if draft_tok.vocab_size != tokenizer.vocab_size or draft_tok.encode(probe) != tokenizer.encode(probe):
        raise ValueError(f"draft model {path} does not share the target's tokenizer")
    fmt = target.model.weight_format
    weights = load_gguf(path, packed=fmt == "native")
    model = LlamaModel(weights, fmt, target.device)
    kv_dtype = target.kv_cache.dtype
    runner = ModelRunner(model, num_blocks, target.block_size, kv_dtype)
    return DraftProposer(runner, shares_target_kv=False)
