"""The native runner: tailguard's C step (kernels/tg_kernels.c) hosted by numpy, in a process that never imports torch.

With native weights on the CPU every step of ordinary traffic is one call of the C step (every layer, paged attention,
the LM head), so torch was only the step's container: its arrays, the KV cache's allocation and the sampler. Importing
it costs a serving process ~193 MiB (its libraries and the Python objects of its ~770 modules) and a second of
start-up. Here those are numpy arrays and a numpy sampler (sampling.py), and the engine (engine.py) picks this
runner whenever it can: native weights on the CPU, no speculative decoding, no sampled internals.

A step this runner does not take itself (a prefill chunk reaching past NATIVE_PREFILL_MAX_CONTEXT positions, where
torch's attention is faster) gets its logits from the torch runner, built on first need over the same weights and
the same KV cache memory: torch is then imported once, and a server whose prompts stay shorter never loads it.
Both runners write and read the same cache in the same format, so a sequence can move between them step by step;
the tokens always come from this runner's sampler.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.engine import kernels
from tailguard.engine.blocks import BlockTable
from tailguard.engine.kv_layout import (
    CPU,
    NATIVE_PREFILL_MAX_CONTEXT,
    allocate_kv_cache,
    decode_step_fits,
    kv_bytes_per_token,
    rope_tables,
    touch_kv_blocks,
)
from tailguard.engine.loader import ModelWeights
from tailguard.engine.sampling import SampledToken, Sampler
from tailguard.engine.scheduler import ScheduledChunk, leading_decode_rows

if TYPE_CHECKING:
    from tailguard.engine.torch_runner import ModelRunner

class NativeModel:
    """The native-format model as the C step reads it: the GGUF's packed blocks, float32 norms and RoPE tables."""

    weight_format = "native"
    uses_decode_kernel = True
    attention_slice_tokens = 0  # the C step slices attention itself (256 keys); set by the engine for the torch runner

    def __init__(self, weights: ModelWeights) -> None:
        cfg = weights.config
        if not isinstance(weights.embed, kernels.PackedMatrix):
            raise ValueError("the native runner reads packed weights (load_gguf(..., packed=True))")
        if not decode_step_fits(cfg):
            raise ValueError("this model's attention shape is outside the C step's limits")
        self.config = cfg
        self.weights = weights
        self.device = CPU
        self.embed, self.lm_head, self.norm = weights.embed, weights.lm_head, weights.norm
        self.layers = weights.layers
        self.cos, self.sin = rope_tables(cfg)

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode token (matrices and the LM head; the embedding row is negligible)."""
        return sum(m.nbytes for lw in self.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)) + self.lm_head.nbytes

    def kv_bytes_per_token(self, kv_dtype: Any) -> int:
        return kv_bytes_per_token(self.config, kv_dtype)


class NativeRunner:
    """The torch-free runner (see the module docstring): the same interface as runner.ModelRunner for the engine."""

    native_prefill_max_context: int = NATIVE_PREFILL_MAX_CONTEXT

    def __init__(self, model: NativeModel, num_blocks: int, block_size: int, kv_dtype: str,
                 num_threads: int | None = None, decode_rows_on_tiles: int = 8) -> None:
        """``num_threads``: the engine's setting, applied to torch too if it is ever loaded (importing torch sets
        the shared OpenMP runtime's count to its own default). ``decode_rows_on_tiles``: EngineArgs'."""
        self.model = model
        self.decode_rows_on_tiles = decode_rows_on_tiles
        self.num_threads = num_threads
        self._threads_set_for: int | None = None  # the thread whose OpenMP count was last set (a per-thread setting)
        self.device = CPU
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, kv_dtype)
        self.sampler = Sampler()
        w = model.weights
        self._step = kernels.DecodeStep(
            config=model.config,
            layers=[(lw.attn_norm, lw.qkv, lw.o, lw.ffn_norm, lw.gate_up, lw.down) for lw in w.layers],
            final_norm=w.norm, embed_w=w.embed, lm_head=w.lm_head, cos=model.cos, sin=model.sin,
            kv_cache=self.kv_cache)
        if self._step.prompt_bf16:
            # Prompt rows on the matrix units attend with each key read once per chunk, as torch's flash attention
            # does, so the hand-off to torch at long contexts no longer pays (EPYC, one prompt, chunks of 512: 3,000
            # tokens 2.7-2.9 s in C against 5.8-7.1 s handed off, 6,000 tokens 7.2-7.9 against 18.5-18.8 s).
            self.native_prefill_max_context = model.config.max_position
        self._torch_runner: ModelRunner | None = None

    def touch_kv_blocks(self, first: int, end: int) -> None:
        """Make never-used blocks [first, end) of the KV cache resident (engine.warm_kv)."""
        touch_kv_blocks(self.kv_cache, first, end)

    # --- the torch runner, for the steps this one does not take -----------------------------------------------------
    def _needs_torch(self, chunks: list[ScheduledChunk]) -> bool:
        """A step the C step does not take: a prefill chunk past its limit (or a verification, never scheduled here:
        the engine gives speculative decoding torch's runner)."""
        return any(c.draft or (not c.is_decode and c.end > self.native_prefill_max_context) for c in chunks)

    def torch_runner(self) -> ModelRunner:
        """The torch runner over this runner's weights and KV cache memory (imports torch, once)."""
        if self._torch_runner is None:
            import torch

            from tailguard.engine.torch_model import LlamaModel
            from tailguard.engine.torch_runner import ModelRunner

            if self.num_threads:
                torch.set_num_threads(self.num_threads)
            model = LlamaModel(self.model.weights, "native", "cpu")
            model.attention_slice_tokens = self.model.attention_slice_tokens
            self._torch_runner = ModelRunner(model, 0, self.block_size, kv_cache=torch.from_numpy(self.kv_cache))
        return self._torch_runner

    @property
    def torch_loaded(self) -> bool:
        return self._torch_runner is not None

    # --- the step -------------------------------------------------------------------------------------------------
    def _build(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable]):
        """The C step's arrays: every token a row attending causally to its own sequence."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        out_rows: list[int] = []
        row_tables: list[list[int]] = []
        bs = self.block_size
        for chunk in chunks:
            table = tables[chunk.seq.request_id]
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(table.slot(p) for p in range(chunk.start, chunk.end))
            if chunk.samples:
                out_rows.append(len(ids) - 1)
            used = table.blocks[: -(-chunk.end // bs)]
            row_tables.extend([used] * chunk.num_tokens)
        widest = max(len(t) for t in row_tables)
        padded = np.zeros((len(row_tables), widest), dtype=np.int32)
        for r, t in enumerate(row_tables):
            padded[r, : len(t)] = t
        pos = np.array(positions, dtype=np.int64)
        return (np.array(ids, dtype=np.int64), pos, np.array(slots, dtype=np.int64), padded,
                (pos + 1).astype(np.int32), np.array(out_rows, dtype=np.int32), leading_decode_rows(chunks))

    def _threads(self) -> None:
        """Apply the engine's thread count on whichever thread steps: the kernels' own pool's count is process-wide,
        but OpenMP's (TAILGUARD_THREAD_POOL=openmp) is a per-thread setting (the server loads and steps on one engine
        thread; AsyncLLMEngine over a built engine steps on another)."""
        ident = threading.get_ident()
        if self.num_threads and ident != self._threads_set_for:
            kernels.set_num_threads(self.num_threads)
            self._threads_set_for = ident

    def chunk_logits(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable]) -> np.ndarray:
        """Run chunks (prefills and decodes) and return the logits of each sampling chunk's last position [n, vocab]."""
        self._threads()
        if self._needs_torch(chunks):
            runner = self.torch_runner()
            runner.native_prefill_max_context = self.native_prefill_max_context  # the same hand-off rule on both
            return runner.chunk_logits(chunks, tables).numpy()
        ids, pos, slots, tabs, lens, rows, decode_rows = self._build(chunks, tables)
        if 0 < self.decode_rows_on_tiles <= decode_rows:
            decode_rows = 0  # every row a tile row (where the weights have tiles; elsewhere the C step ignores it)
        return self._step(ids, pos, slots, tabs, lens, rows, decode_rows)

    def execute(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable],
                stop_ids: set[int], probe: Any = None) -> list[list[SampledToken]]:
        """Run one step; each chunk's new tokens: none for a prefill chunk that does not reach the end of its prompt,
        one for a decode or a last prefill chunk."""
        if not chunks:
            return []
        if probe is not None:  # instrumented steps run in torch (the engine gives sampled internals torch's runner)
            return self.torch_runner().execute(chunks, tables, stop_ids, probe)
        # Logits from the C step, or from torch for a step past the C limit; the tokens always from this sampler, so
        # that a seeded request's draws do not depend on who shares its steps.
        logits = self.chunk_logits(chunks, tables)
        sampled = iter(self.sampler.sample(logits, [c.seq for c in chunks if c.samples], stop_ids))
        return [[next(sampled)] if c.samples else [] for c in chunks]

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self._torch_runner is not None:
            self._torch_runner.release(request_id)
