"""The KV cache's layout and the model-shape facts both runners share: the row format (float, or int8 with its scale),
the cache's shape and allocation, the RoPE tables, the Hadamard turn of int8 rows, and the limits of the one-call C
step. Plain numpy: the native runner, the torch model and the engine read these without importing each other."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from tailguard.engine import kernels

# Where prompt rows go through the block kernels (no bfloat16 tiles), a step whose prefill chunks all end within this
# many positions runs as rows of the one-call C step (faster at short contexts: 2.4x at 256 tokens, 1.3x at 2K);
# beyond it the step runs in torch, whose flash attention reuses each key across a chunk's query rows where the block
# kernels read it once per row. Measured (benchmarks/prefill_paths.py, TTFT of one prompt, every chunk in C vs torch,
# same process): 256 tokens 0.34 vs 0.82 s, 1K 1.95 vs 3.54 s, 2K 5.47 vs 7.21 s, 4K 18.32 vs 18.11 s. With prompt
# rows on the tiles there is no hand-off (native_runner.py).
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
    Queries turn the same way ((Hq) . (Hk) = q . k) and the attention output turns back. tg_kernels.c and torch_model.py
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


def touch_kv_blocks(kv_cache, first: int, end: int) -> None:
    """Write zeros into blocks [first, end) of every layer's K and V (a numpy array or a CPU tensor laid out [layer,
    k|v, block, ...]): their pages become resident now instead of at a step's first write. Only for blocks that were
    never handed out, which read as zeros anyway."""
    kv_cache[:, :, first:end] = 0


def rope_tables(config) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [max_position, head_dim] float32: x * cos + rotate_half(x) * sin == x * cos + roll(x, half)
    * [-sin, sin], the sign kept in the table (torch_model.py and tg_kernels.c read these same tables)."""
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
