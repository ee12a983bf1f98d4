"""A Llama-family transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU) that reads K/V through block tables.

The model works on a flat batch of tokens from many sequences (decodes and prefill chunks mixed). Linear layers run
once over all tokens; attention runs once for all decode tokens (keys gathered from the paged cache into a padded
batch) and once per prefill chunk. Logits are computed only at the positions that are sampled: on this CPU the LM head
(49152 x 576) costs more than a whole layer. With native weights a step runs whole in tg_kernels.c, one call for
every layer, each token of a prefill chunk a row that attends causally to its sequence, unless a prefill chunk
reaches past NATIVE_PREFILL_MAX_CONTEXT positions; those steps, the other formats and a step whose internals are
sampled run here in torch.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tailguard.engine import kernels
from tailguard.engine.kernels import PackedMatrix
from tailguard.engine.kv_layout import (
    DEFAULT_ATTENTION_SLICE_TOKENS,
    KV_INT8_SCALE_BYTES,
    allocate_kv_cache,
    decode_step_fits,
    kv_cache_shape,
    kv_rotated,
    rope_tables,
)
from tailguard.engine.kv_layout import kv_bytes_per_token as _kv_bytes_per_token
from tailguard.engine.kv_layout import kv_row_bytes as _kv_row_bytes
from tailguard.engine.loader import ModelWeights

if TYPE_CHECKING:
    from tailguard.engine.internals import StepProbe

# native: the GGUF's own blocks (Q4_1/Q8_0 for SmolLM2) multiplied with float32 activations by tailguard's kernels;
# the same numbers as float32 (whose weights are those blocks dequantized) at a sixth of the bytes. CPU only.
WEIGHT_FORMATS = ("native", "float32", "bfloat16", "int8")

# Above this many tokens a product dequantizes its weight once and lets the BLAS sgemm run (prefill); below it the
# kernels read the blocks directly (decode). Measured crossover on this machine class: benchmarks/native_kernels.py.
NATIVE_GEMM_MIN_TOKENS = 192

# NATIVE_PREFILL_MAX_CONTEXT (kv_layout.py): a step whose prefill chunks all end within it runs as rows of the one-call C
# step; beyond it the step runs here in torch. KV_INT8_SCALE_BYTES: the int8 KV row's float16 scale.
# DEFAULT_ATTENTION_SLICE_TOKENS: the torch paths' attention slice.


# Decode rows of a torch step (steps that mix decodes with prefill chunks) attend in groups of at most this many keys
# in all (rows x the widest slice): the float copy of a group's gathered K/V, with its int8 dequantization temporaries,
# stays a few MiB. Gathering all rows at once, 31 decodes at 2K held ~150 MB per layer, which set the server's peak
# under 32 long conversations. Rows are independent, and a group keeps the step's padded width, slices and masks, so
# its numbers are those of the whole batch (tests/engine/test_serve_memory.py checks that they are equal).
DECODE_ATTENTION_GROUP_KEYS = 8192


def rotates_kv(kv_dtype: torch.dtype, head_dim: int) -> bool:
    """int8 K/V rows are stored turned by the Hadamard transform (kv_layout.kv_rotated, which says why)."""
    return kv_rotated(kernels.dtype_name(kv_dtype), head_dim)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthonormal Hadamard matrix of size n (a power of two) in Sylvester order: H[i, j] = (-1)^popcount(i & j)
    / sqrt(n), symmetric and its own inverse (tg_kernels.c's hadamard applies it by butterflies)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"no Hadamard matrix of size {n} here (a power of two)")
    return (h / math.sqrt(n)).to(dtype)


def _as_torch(a: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A numpy array (the packed loader's norms, a dequantized matrix) as a tensor over the same memory."""
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


def kv_row_bytes(kv_dtype: torch.dtype | str, head_dim: int) -> int:
    """Bytes of one stored (position, kv head) row of K or V."""
    return _kv_row_bytes(kernels.dtype_name(kv_dtype), head_dim)


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 2] int8 rows: round-half-even(x / s) in [-127, 127], then s as
    float16 bytes, s = max|x| / 127 rounded to float16 first (the numbers tg_kernels.c's kv_store writes)."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    divisor = scale.float()
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)  # an all-zero row stores zeros
    q = torch.round(x / divisor).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., head_dim + 2] int8 rows -> [..., head_dim] values (only the rows given: a step's own blocks)."""
    scale = rows[..., -KV_INT8_SCALE_BYTES:].contiguous().view(torch.float16)
    return (rows[..., :-KV_INT8_SCALE_BYTES].to(dtype) * scale.to(dtype))


def _kv_values(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K or V rows as attention reads them."""
    if stored.dtype == torch.int8:
        return dequantize_kv(stored, dtype)
    return stored.to(dtype)


@dataclass
class PrefillSpan:
    token_start: int  # index of the chunk's first token in the flat batch
    token_end: int
    gather: torch.Tensor | None  # [blocks] the sequence's block table; None when the chunk starts at 0
    mask: torch.Tensor | None  # [n, blocks * block_size] causal mask with the chunk's offset; None when it starts at 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    positions: torch.Tensor  # [T]
    num_decodes: int
    decode_gather: torch.Tensor | None  # [D, max_blocks] each decode's block table (padded with block 0)
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] True where a key is real
    prefills: list[PrefillSpan]
    decode_lens: torch.Tensor | None = None  # [D] int32: keys each decode attends to (its position + 1)
    # The one-call C step: its first rows are decodes and verifications, the rest prompt tokens (None: all decodes)
    num_decode_rows: int | None = None


class Linear:
    """y = x @ W^T in the chosen weight format. int8: per-channel int8 weights times per-token int8 activations with
    exact int32 sums (torch._int_mm); native reads the GGUF's blocks with tailguard's kernels."""

    def __init__(self, weight: torch.Tensor | PackedMatrix, fmt: str) -> None:
        self.fmt = fmt
        self.out_features = weight.out_features if isinstance(weight, PackedMatrix) else weight.shape[0]
        self.packed = weight if isinstance(weight, PackedMatrix) else None
        self.in_features = weight.in_features if isinstance(weight, PackedMatrix) else weight.shape[1]
        self.weight: torch.Tensor | None  # the dense weight (float32 and bfloat16 formats)
        if fmt == "native":
            if self.packed is None:
                raise ValueError("the native format needs packed weights (load_gguf(..., packed=True))")
            self.weight = None
        elif fmt == "int8":
            assert isinstance(weight, torch.Tensor), "the int8 format quantizes a dense weight"
            w = weight.float()
            self._wscale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # per output channel
            self._qweight = torch.round(w / self._wscale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
            self.weight = None
        else:
            # a packed matrix in another format runs through the kernels all the same (``packed``)
            self.weight = None if isinstance(weight, PackedMatrix) else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if x.shape[0] < NATIVE_GEMM_MIN_TOKENS:
                return kernels.linear(x, self.packed)
            return F.linear(x, _as_torch(self.packed.dequantize()))
        if self.fmt == "int8":
            # Each token's activations get their own scale (fbgemm's dynamic kernel used one for the whole step, so
            # one token's outlier coarsened every other token's: answers depended on who shared the step). Integer
            # sums are exact, so a row's result is the same alone or in any batch.
            sx = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
            acc = torch._int_mm(torch.round(x / sx).to(torch.int8), self._qweight.t())
            return acc.float() * sx * self._wscale
        assert self.weight is not None  # float32 or bfloat16, not packed: the dense weight is set
        if self.fmt == "bfloat16":
            return F.linear(x.to(torch.bfloat16), self.weight).float()
        return F.linear(x, self.weight)


class LlamaModel:
    # Keys per attention slice in the torch paths (decode and prefill over a cached prefix); 0: no slicing.
    attention_slice_tokens: int = DEFAULT_ATTENTION_SLICE_TOKENS

    def __init__(self, weights: ModelWeights, weight_format: str = "float32", device: str | torch.device = "cpu") -> None:
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}")
        if weight_format in ("int8", "native") and torch.device(device).type != "cpu":
            raise ValueError(f"the {weight_format} weight format runs on the CPU only")
        cfg = weights.config
        self.config = cfg
        self.device = torch.device(device)
        self.weight_format = weight_format
        # The residual stream, norms, RoPE and the KV cache stay float32 whatever the weight format: with a bf16
        # residual stream SmolLM2 answers "What is the capital of France?" with nonsense. Only matmuls change format.
        self.dtype = torch.float32
        weight_dtype = torch.bfloat16 if weight_format == "bfloat16" else torch.float32

        def dev(t: torch.Tensor | np.ndarray) -> torch.Tensor:
            return _as_torch(t).to(device=self.device, dtype=self.dtype)

        def lin(t: torch.Tensor | PackedMatrix) -> Linear:
            if isinstance(t, PackedMatrix):
                return Linear(t, weight_format)
            return Linear(t.to(device=self.device, dtype=weight_dtype), weight_format)

        native = weight_format == "native"
        if native != isinstance(weights.embed, PackedMatrix):
            raise ValueError("load the GGUF with packed=True for the native format, and only for it")
        self.embed: torch.Tensor | PackedMatrix = weights.embed if native else dev(weights.embed)
        self.layers = [
            (dev(lw.attn_norm), lin(lw.qkv), lin(lw.o), dev(lw.ffn_norm), lin(lw.gate_up), lin(lw.down))
            for lw in weights.layers
        ]
        self.norm = dev(weights.norm)
        self.lm_head = lin(weights.lm_head)
        head_dim = cfg.head_dim
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table, one op per layer less.
        # The native runner's tables, the same numbers.
        cos, sin = rope_tables(cfg)
        self.cos, self.sin = dev(cos), dev(sin)
        self._native_step_fits = decode_step_fits(cfg)
        self._hadamard = hadamard_matrix(head_dim, self.dtype).to(self.device) if kv_rotated("int8", head_dim) else None
        self._decode_step: kernels.DecodeStep | None = None
        self._decode_step_cache: torch.Tensor | None = None

    @property
    def uses_decode_kernel(self) -> bool:
        """Decodes run in tg_kernels.c's one-call step (native weights, shapes within its limits)."""
        return self.weight_format == "native" and self._native_step_fits

    def weight_bytes(self) -> int:
        """Bytes of weights read per decode token (matrices and the LM head; the embedding row is negligible)."""
        total = 0
        for layer in self.layers:
            for lin in (layer[1], layer[2], layer[4], layer[5]):
                total += lin.packed.nbytes if lin.packed is not None else _dense_bytes(lin)
        return total + (self.lm_head.packed.nbytes if self.lm_head.packed is not None else _dense_bytes(self.lm_head))

    def _native_decode(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """A step in one call of the C kernels (every layer, paged attention, the LM head at ``logits_indices``)."""
        if self._decode_step is None or self._decode_step_cache is not kv_cache:
            # native weights (uses_decode_kernel): the embedding and the LM head are packed
            assert isinstance(self.embed, PackedMatrix) and self.lm_head.packed is not None
            self._decode_step = kernels.DecodeStep(
                config=self.config,
                layers=[(an, qkv.packed, o.packed, fn, gu.packed, dn.packed) for an, qkv, o, fn, gu, dn in self.layers],
                final_norm=self.norm, embed_w=self.embed, lm_head=self.lm_head.packed, cos=self.cos, sin=self.sin,
                kv_cache=kv_cache)
            self._decode_step_cache = kv_cache
        assert meta.decode_gather is not None and meta.decode_lens is not None
        return self._decode_step(input_ids, meta.positions, meta.slot_mapping, meta.decode_gather, meta.decode_lens,
                                 logits_indices, meta.num_decode_rows)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | str) -> int:
        return _kv_bytes_per_token(self.config, kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
        # [layer, k|v, block, slot-in-block, kv_head, head_dim]: gathering whole blocks moves block_size rows per index.
        # int8: the last dimension is head_dim + 2 bytes (values, then the row's float16 scale), so a block carries its
        # own scales wherever it is copied or gathered.
        cfg = self.config
        dtype = kv_dtype or self.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            raise ValueError(f"unsupported KV cache dtype {dtype}")
        shape = kv_cache_shape(cfg, num_blocks, block_size, kernels.dtype_name(dtype))
        if self.device.type == "cpu" and dtype != torch.bfloat16:
            # Anonymous memory that becomes resident as blocks are first written (lean.allocate_kv_cache says why)
            return torch.from_numpy(allocate_kv_cache(cfg, num_blocks, block_size, kernels.dtype_name(dtype)))
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin, with rotate_half's negation folded into ``signed_sin``.
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)

    @staticmethod
    def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, slice_tokens: int = 0) -> torch.Tensor:
        """One query token per decoding sequence against its paged keys: [D, H, hd]. Contexts wider than
        ``slice_tokens`` keys (> 0) are attended slice by slice (attention_sliced). Rows go in groups of at most
        DECODE_ATTENTION_GROUP_KEYS keys (rows x the widest slice)."""
        assert meta.decode_gather is not None and meta.decode_mask is not None
        bs = k_cache.shape[1]
        width = meta.decode_gather.shape[1] * bs
        if slice_tokens > 0:
            width = min(width, slice_blocks(slice_tokens, bs) * bs)
        rows = max(1, DECODE_ATTENTION_GROUP_KEYS // width)
        # keys every sequence of the step has: slices below this need no mask (the whole step's figure, so that a
        # group makes the same choice as the whole batch)
        common = int(meta.decode_lens.min()) if meta.decode_lens is not None else 0
        if q.shape[0] <= rows:
            return LlamaModel._decode_attention_rows(q, k_cache, v_cache, meta.decode_gather, meta.decode_mask, common,
                                                     slice_tokens)
        return torch.cat([
            LlamaModel._decode_attention_rows(q[r : r + rows], k_cache, v_cache, meta.decode_gather[r : r + rows],
                                              meta.decode_mask[r : r + rows], common, slice_tokens)
            for r in range(0, q.shape[0], rows)])

    @staticmethod
    def _decode_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode_gather: torch.Tensor,
                               decode_mask: torch.Tensor, common: int, slice_tokens: int) -> torch.Tensor:
        """_decode_attention for some rows of the step (their block tables padded to the step's width)."""
        bs = k_cache.shape[1]
        n_blocks = decode_gather.shape[1]
        if slice_tokens <= 0 or n_blocks * bs <= slice_tokens:
            # Short contexts (most steps): one gather, one SDPA. Only the step's own blocks are gathered (and, for
            # int8, dequantized): never a float copy of the cache.
            kd = _kv_values(k_cache[decode_gather], q.dtype).flatten(1, 2).transpose(1, 2)  # [D, kv, L, hd]
            vd = _kv_values(v_cache[decode_gather], q.dtype).flatten(1, 2).transpose(1, 2)
            od = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=decode_mask, enable_gqa=True)
            return od.squeeze(2)
        n_dec, n_heads, head_dim = q.shape
        n_kv = k_cache.shape[2]
        step = slice_blocks(slice_tokens, bs)
        mask = decode_mask.view(n_dec, 1, 1, 1, -1)  # broadcast over [D, kv, group, 1 query, keys]

        def slices():
            for b0 in range(0, n_blocks, step):
                gather = decode_gather[:, b0 : b0 + step]
                k = _kv_values(k_cache[gather], q.dtype).flatten(1, 2).transpose(1, 2)  # [D, kv, S, hd]
                v = _kv_values(v_cache[gather], q.dtype).flatten(1, 2).transpose(1, 2)
                end = (b0 + gather.shape[1]) * bs
                yield k, v, None if end <= common else mask[..., b0 * bs : end]

        out = attention_sliced(q.view(n_dec, n_kv, n_heads // n_kv, 1, head_dim), slices())
        return out.reshape(n_dec, n_heads, head_dim)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor, logits_indices: torch.Tensor,
        probe: StepProbe | None = None,
    ) -> torch.Tensor:
        """Logits at ``logits_indices``. ``probe`` (sampled internals, engine/internals.py) times each layer and reads
        its activations; a probed step runs in torch even where the one-call C decode step would take it."""
        cfg = self.config
        n_tok = input_ids.shape[0]
        d = meta.num_decodes
        if probe is None and self.uses_decode_kernel and d == n_tok:
            # Every token a row (the runner builds prefill chunks as rows too): one C call for the step, whatever it
            # mixes. A row's numbers depend on its own sequence only, so they are the same however its prompt was
            # chunked and whoever shares the step.
            return self._native_decode(input_ids, meta, kv_cache, logits_indices)
        n_heads, n_kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = n_heads * head_dim, n_kv * head_dim
        cos = self.cos[meta.positions].unsqueeze(1)
        sin = self.sin[meta.positions].unsqueeze(1)
        rotated = rotates_kv(kv_cache.dtype, head_dim)
        if probe is not None:
            probe.step_begin()
        # the embedding is packed exactly when the weights are native (checked in __init__)
        embed = self.embed
        x = kernels.embed(input_ids, embed) if isinstance(embed, PackedMatrix) else embed[input_ids]
        for layer_idx, (attn_norm, qkv_proj, o_proj, ffn_norm, gate_up_proj, down_proj) in enumerate(self.layers):
            if probe is not None:
                probe.layer_begin()
            h = F.rms_norm(x, (cfg.hidden_size,), attn_norm, cfg.rms_eps)
            qkv = qkv_proj(h)
            # Q and K heads rotated together: one RoPE for both.
            qk = self._rope(qkv[:, : q_dim + kv_dim].view(n_tok, n_heads + n_kv, head_dim), cos, sin)
            v = qkv[:, q_dim + kv_dim :].view(n_tok, n_kv, head_dim)
            if rotated:
                assert self._hadamard is not None  # built for int8 K/V with this head_dim (rotates_kv)
                qk, v = qk @ self._hadamard, v @ self._hadamard
            q, k = qk[:, :n_heads], qk[:, n_heads:]
            k_cache, v_cache = kv_cache[layer_idx, 0], kv_cache[layer_idx, 1]
            # Attention always sees K/V as stored, whichever path reads them (the decode kernel reads the cache).
            if kv_cache.dtype == torch.int8:
                k, v = quantize_kv(k), quantize_kv(v)
            elif kv_cache.dtype != x.dtype:
                k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
            k_cache.view(-1, n_kv, kv_cache.shape[-1]).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, n_kv, kv_cache.shape[-1]).index_copy_(0, meta.slot_mapping, v)
            k, v = _kv_values(k, x.dtype), _kv_values(v, x.dtype)
            if d == n_tok:  # a decode-only step (most steps): no buffer to assemble
                attn = self._decode_attention(q, k_cache, v_cache, meta, self.attention_slice_tokens)
            else:
                attn = torch.empty(n_tok, n_heads, head_dim, dtype=x.dtype, device=x.device)
                if d:
                    attn[:d] = self._decode_attention(q[:d], k_cache, v_cache, meta, self.attention_slice_tokens)
            for span in meta.prefills:
                qp = q[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
                if span.gather is None:
                    kp = k[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
                    vp = v[span.token_start : span.token_end].transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                elif self.attention_slice_tokens > 0 and span.gather.shape[0] * kv_cache.shape[3] > (
                        self.attention_slice_tokens):
                    # A chunk against a long cached prefix: key tiles, so the scores stay [H, n, tile] wide.
                    assert span.mask is not None  # set with ``gather`` (the chunk starts past 0)
                    op = prefill_attention_tiled(qp[0], k_cache, v_cache, span.gather, span.mask,
                                                 self.attention_slice_tokens).unsqueeze(0)
                else:
                    kp = _kv_values(k_cache[span.gather], qp.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
                    vp = _kv_values(v_cache[span.gather], qp.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
                    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, enable_gqa=True)
                attn[span.token_start : span.token_end] = op.squeeze(0).transpose(0, 1)
            if rotated:
                assert self._hadamard is not None
                attn = attn @ self._hadamard
            x = x + o_proj(attn.reshape(n_tok, q_dim))
            if probe is not None:
                probe.attention_done(q, kv_cache, layer_idx)
            h = F.rms_norm(x, (cfg.hidden_size,), ffn_norm, cfg.rms_eps)
            gate, up = gate_up_proj(h).chunk(2, dim=-1)
            x = x + down_proj(F.silu(gate) * up)
            if probe is not None:
                probe.layer_done(x)
        x = F.rms_norm(x[logits_indices], (cfg.hidden_size,), self.norm, cfg.rms_eps)
        logits = self.lm_head(x).float()
        if probe is not None:
            probe.step_done()
        return logits


def slice_blocks(slice_tokens: int, block_size: int) -> int:
    """KV blocks per attention slice: ``slice_tokens`` rounded down to whole blocks, at least one."""
    return max(1, slice_tokens // block_size)


# The fused flash-attention kernel that F.scaled_dot_product_attention runs on the CPU, called directly because it
# also returns each row's log-sum-exp, which merging slices needs and the public function drops. Elsewhere (CUDA, or
# a torch without it) slices go through _slice_attention_unfused: the same numbers, about half the speed on the CPU.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _slice_attention_fused(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, kv, r, hd] against k, v [B, kv, S, hd]; mask: additive float [B or 1, 1, r, S] or None.
    Returns (softmax-normalized output [B, kv, r, hd], log-sum-exp of the scaled scores [B, kv, r])."""
    assert _FLASH_CPU is not None  # attention_sliced calls this only where torch has the kernel
    out, lse = _FLASH_CPU(rows, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, lse


def _slice_attention_unfused(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As _slice_attention_fused, in plain torch ops (scores for one slice only)."""
    scores = torch.matmul(rows * scale, k.transpose(-1, -2))
    if mask is not None:
        scores = scores.add_(mask)
    row_max = scores.amax(dim=-1, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)
    probs = torch.exp_(scores.sub_(row_max))
    total = probs.sum(dim=-1, keepdim=True)
    out = torch.matmul(probs, v).div_(total.clamp(min=torch.finfo(total.dtype).tiny))
    return out, (row_max + total.log()).squeeze(-1)


def attention_sliced(q: torch.Tensor, slices) -> torch.Tensor:
    """Softmax attention over keys that arrive in slices, merged by log-sum-exp (flash-decoding): each slice gives
    its normalized output o_i and log-sum-exp l_i, and out = sum_i o_i * exp(l_i - logsumexp_i(l_i)), accumulated
    slice by slice. Nothing wider than one slice of keys (and its scores) is ever materialized.

    q: [..., kv, group, n, hd] (query heads grouped under their KV head, GQA). ``slices`` yields (k, v, mask):
    k, v [..., kv, S, hd]; mask (True where a key is visible) broadcastable to [..., 1, group, n, S] (one mask for
    every head), or None when every query sees every key of the slice. Returns [..., kv, group, n, hd]; a query that
    sees no key at all gets zeros.
    """
    *lead, n_kv, group, n_q, head_dim = q.shape
    batch = math.prod(lead)
    rows = q.reshape(batch, n_kv, group * n_q, head_dim)  # the group's heads as extra query rows of their KV head
    scale = 1.0 / math.sqrt(head_dim)
    fused = _FLASH_CPU is not None and q.device.type == "cpu"
    floor = torch.finfo(q.dtype).min  # a finite stand-in for -inf: exp(-inf - floor) = 0, never nan
    out: torch.Tensor | None = None
    run_lse: torch.Tensor | None = None
    for k, v, mask in slices:
        k = k.reshape(batch, n_kv, k.shape[-2], head_dim) if lead else k.unsqueeze(0)
        v = v.reshape(batch, n_kv, v.shape[-2], head_dim) if lead else v.unsqueeze(0)
        additive = None
        if mask is not None:
            shape = (*lead, 1, group, n_q, k.shape[-2])
            additive = torch.zeros(shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            additive = additive.view(batch, 1, group * n_q, k.shape[-2])
        part, lse = (_slice_attention_fused if fused else _slice_attention_unfused)(rows, k, v, additive, scale)
        if mask is not None:
            # a row that sees no key of this slice contributes nothing (the fused kernel reports lse 0 for it)
            seen = mask.any(dim=-1).expand(*lead, 1, group, n_q).reshape(batch, 1, group * n_q)
            lse = lse.masked_fill(~seen, float("-inf"))
        lse = lse.unsqueeze(-1)
        if out is None:
            out, run_lse = part, lse
            continue
        assert run_lse is not None  # set with ``out``
        merged = torch.logaddexp(run_lse, lse).clamp_(min=floor)
        out = out.mul_(torch.exp(run_lse - merged)).add_(part.mul_(torch.exp(lse - merged)))
        run_lse = merged
    if out is None:
        raise ValueError("attention over no keys")
    return out.reshape(*lead, n_kv, group, n_q, head_dim)


def prefill_attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gather: torch.Tensor,
                            mask: torch.Tensor, slice_tokens: int) -> torch.Tensor:
    """A prefill chunk's queries q [H, n, hd] against its sequence's cached keys (block table ``gather``, causal
    ``mask`` [n, blocks * block_size]), key tile by key tile: [H, n, hd]."""
    n_heads, n_q, head_dim = q.shape
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    step = slice_blocks(slice_tokens, bs)

    def tiles():
        for b0 in range(0, gather.shape[0], step):
            blocks = gather[b0 : b0 + step]
            k = _kv_values(k_cache[blocks], q.dtype).flatten(0, 1).transpose(0, 1)  # [kv, S, hd]
            v = _kv_values(v_cache[blocks], q.dtype).flatten(0, 1).transpose(0, 1)
            end = (b0 + blocks.shape[0]) * bs
            # the mask is causal: a tile the chunk's first query sees whole, every query sees whole
            yield k, v, None if bool(mask[0, end - 1]) else mask[:, b0 * bs : end]

    out = attention_sliced(q.view(n_kv, n_heads // n_kv, n_q, head_dim), tiles())
    return out.view(n_heads, n_q, head_dim)


def _dense_bytes(lin: Linear) -> int:
    if lin.weight is not None:
        return lin.weight.numel() * lin.weight.element_size()
    return lin.out_features * lin.in_features  # int8: one byte a weight
