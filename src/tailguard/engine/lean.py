"""The lean runner: tailguard's C step (kernels/tg_kernels.c) hosted by numpy, in a process that never imports torch.

With native weights on the CPU every step of ordinary traffic is one call of the C step (every layer, paged attention,
the LM head), so torch was only the step's container: its arrays, the KV cache's allocation and the sampler. Importing
it costs a serving process ~193 MiB (its libraries and the Python objects of its ~770 modules) and a second of
start-up. Here those are numpy arrays and a numpy sampler (lean_sampling.py), and the engine (engine.py) picks this
runner whenever it can: native weights on the CPU, no speculative decoding, no sampled internals.

A step this runner does not take itself (a prefill chunk reaching past NATIVE_PREFILL_MAX_CONTEXT positions, where
torch's attention is faster) gets its logits from the torch runner, built on first need over the same weights and
the same KV cache memory: torch is then imported once, and a server whose prompts stay shorter never loads it.
Both runners write and read the same cache in the same format, so a sequence can move between them step by step;
the tokens always come from this runner's sampler.
"""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tailguard.engine import kernels
from tailguard.engine.blocks import BlockTable
from tailguard.engine.lean_sampling import SampledToken, Sampler
from tailguard.engine.loader import ModelWeights
from tailguard.engine.scheduler import ScheduledChunk, leading_decode_rows

if TYPE_CHECKING:
    from tailguard.engine.runner import ModelRunner

# A step whose prefill chunks all end within this many positions runs as rows of the one-call C step (faster at short
# contexts: 2.4x at 256 tokens, 1.3x at 2K); beyond it the step runs in torch, whose flash attention reuses each key
# across a chunk's query rows where the C step reads it once per row. Measured (benchmarks/prefill_paths.py, TTFT of
# one prompt, every chunk in C vs torch, same process): 256 tokens 0.34 vs 0.82 s, 1K 1.95 vs 3.54 s, 2K 5.47 vs
# 7.21 s, 4K 18.32 vs 18.11 s.
NATIVE_PREFILL_MAX_CONTEXT = 2048

# Attention over a context longer than this many keys runs in slices of about this size (whole KV blocks), merged by
# log-sum-exp (flash-decoding): per step the float copy of the gathered K/V and the scores stay one slice wide
# whatever the context. 0 turns slicing off (one gather and one SDPA over the whole context). Default: the size
# measured on this machine class to cost nothing at short contexts and the least at 8K (benchmarks/long_context.py).
DEFAULT_ATTENTION_SLICE_TOKENS = 1024

# int8 KV rows: head_dim int8 values, then the row's float16 scale (2 bytes): one scale per (position, kv head) for K
# and for V. Per token and head, because each new token's K/V is quantized alone as it is written (no block-wide
# scale to revise as a block fills) and key ranges differ widely between heads. float16, not float32, for the scale:
# its 11-bit mantissa is far finer than the 8-bit values it scales, and 2 bytes a row instead of 4 give 66 bytes a
# row for head_dim 64 (1.94x float16's tokens per byte, 3.9x float32's) instead of 68 (1.88x, 3.8x).
KV_INT8_SCALE_BYTES = 2
KV_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True)
class Device:
    """Where a lean model runs: always the CPU (a torch.device stands in the same places for the torch runner)."""

    type: str = "cpu"

    def __str__(self) -> str:
        return self.type


CPU = Device()


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one stored (position, kv head) row of K or V (``kv_dtype``: a name, as kernels.dtype_name gives)."""
    if kv_dtype == "int8":
        return head_dim + KV_INT8_SCALE_BYTES
    return head_dim * KV_ITEM_BYTES[kv_dtype]


def kv_rotated(kv_dtype: str, head_dim: int) -> bool:
    """int8 K/V rows are stored turned by the orthonormal Hadamard transform (head_dim a power of two): the outlier
    channels of a head no longer set its row's one scale, so the rounding error spreads evenly (QuaRot's trick).
    Queries turn the same way ((Hq) . (Hk) = q . k) and the attention output turns back. tg_kernels.c and model.py
    do exactly this. Mean per-token change of -log p against a float32 cache on the shipped texts: 0.024 / 0.029
    (en / zh) unturned, 0.012 / 0.016 turned (benchmarks/kv_rotation.py); pooled perplexity through the C step -0.04%
    (benchmarks/fidelity.py)."""
    return kv_dtype == "int8" and head_dim >= 2 and head_dim & (head_dim - 1) == 0


def kv_bytes_per_token(config, kv_dtype: Any) -> int:
    """Bytes of K and V a token takes in the cache, every layer and KV head (``kv_dtype``: a name or a dtype)."""
    return config.num_layers * 2 * config.num_kv_heads * kv_row_bytes(kernels.dtype_name(kv_dtype), config.head_dim)


def kv_cache_shape(config, num_blocks: int, block_size: int, kv_dtype: str) -> tuple[int, ...]:
    """[layer, k|v, block, slot-in-block, kv_head, row]: gathering whole blocks moves block_size rows per index. int8:
    a row is head_dim + 2 bytes (values, then the row's float16 scale), so a block carries its own scales."""
    row = kv_row_bytes(kv_dtype, config.head_dim) if kv_dtype == "int8" else config.head_dim
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, row)


def allocate_kv_cache(config, num_blocks: int, block_size: int, kv_dtype: str) -> np.ndarray:
    """The KV cache in anonymous memory: the OS hands out zero pages that become resident only as blocks are first
    written, so the process holds the memory its traffic needs, up to the budget. Slots never written read as zeros,
    so masked attention over whole blocks never meets garbage (an int8 row of zeros has a zero scale: zeros)."""
    if kv_dtype not in ("float32", "float16", "int8"):
        raise ValueError(f"unsupported KV cache dtype {kv_dtype} (float32, float16, int8)")
    shape = kv_cache_shape(config, num_blocks, block_size, kv_dtype)
    nbytes = math.prod(shape) * KV_ITEM_BYTES[kv_dtype]
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.dtype(kv_dtype), count=math.prod(shape)).reshape(shape)


def rope_tables(config) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [max_position, head_dim] float32: x * cos + rotate_half(x) * sin == x * cos + roll(x, half)
    * [-sin, sin], the sign kept in the table (model.py and tg_kernels.c read these same tables)."""
    head_dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(config.max_position, dtype=np.float64), inv_freq)
    emb = np.concatenate([angles, angles], axis=-1)
    sin = np.sin(emb)
    signed = np.concatenate([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], axis=-1)
    return np.ascontiguousarray(np.cos(emb), dtype=np.float32), np.ascontiguousarray(signed, dtype=np.float32)


def decode_step_fits(config) -> bool:
    """The one-call C step's limits (tg_kernels.c): head_dim <= 512, at most 16 query heads per KV head."""
    return config.head_dim <= 512 and config.num_heads % config.num_kv_heads == 0 and (
        config.num_heads // config.num_kv_heads <= 16)


class LeanModel:
    """The native-format model as the C step reads it: the GGUF's packed blocks, float32 norms and RoPE tables."""

    weight_format = "native"
    uses_decode_kernel = True
    attention_slice_tokens = 0  # the C step slices attention itself (256 keys); set by the engine for the torch runner

    def __init__(self, weights: ModelWeights) -> None:
        cfg = weights.config
        if not isinstance(weights.embed, kernels.PackedMatrix):
            raise ValueError("the lean runner reads packed weights (load_gguf(..., packed=True))")
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


class LeanRunner:
    """The torch-free runner (see the module docstring): the same interface as runner.ModelRunner for the engine."""

    native_prefill_max_context: int = NATIVE_PREFILL_MAX_CONTEXT

    def __init__(self, model: LeanModel, num_blocks: int, block_size: int, kv_dtype: str,
                 num_threads: int | None = None) -> None:
        """``num_threads``: the engine's setting, applied to torch too if it is ever loaded (importing torch sets
        the shared OpenMP runtime's count to its own default)."""
        self.model = model
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
        self._torch_runner: ModelRunner | None = None

    # --- the torch runner, for the steps this one does not take -----------------------------------------------------
    def _needs_torch(self, chunks: list[ScheduledChunk]) -> bool:
        """A step the C step does not take: a prefill chunk past its limit (or a verification, never scheduled here:
        the engine gives speculative decoding torch's runner)."""
        return any(c.draft or (not c.is_decode and c.end > self.native_prefill_max_context) for c in chunks)

    def torch_runner(self) -> ModelRunner:
        """The torch runner over this runner's weights and KV cache memory (imports torch, once)."""
        if self._torch_runner is None:
            import torch

            from tailguard.engine.model import LlamaModel
            from tailguard.engine.runner import ModelRunner

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
