"""GGUF -> weights for Llama-family models, and a tiny random-weight model of the same architecture.

Packed (the native format) the matrices keep the file's blocks in numpy arrays and nothing here imports torch (the
native runner serves without it); dequantized (the other formats) they are torch tensors.

llama.cpp's converter permutes the rows of the Q and K projections so that its RoPE can rotate adjacent pairs; we undo
that permutation so that the model uses the usual rotate-half RoPE of the Hugging Face reference. Forgetting this
produces fluent-looking garbage with no error, which the reference test against transformers catches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from tailguard.engine.config import ModelConfig
from tailguard.engine.gguf_file import GGUFFile, TensorInfo, read_gguf
from tailguard.engine.kernels import F16, F32, NATIVE_FORMATS, PackedMatrix, kernel_layout

if TYPE_CHECKING:
    import torch

# A matrix is a float tensor, or (``packed=True``) a PackedMatrix that keeps the GGUF's own quantized blocks.
Matrix = Any  # torch.Tensor | PackedMatrix
Vector = Any  # a norm's weights: float32 numpy (packed) or a torch tensor


@dataclass
class LayerWeights:
    attn_norm: Vector
    qkv: Matrix  # [q_dim + 2 * kv_dim, hidden]: Q, K and V fused into one matmul
    o: Matrix
    ffn_norm: Vector
    gate_up: Matrix  # [2 * intermediate, hidden]: gate and up fused into one matmul
    down: Matrix


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: Matrix
    layers: list[LayerWeights]
    norm: Vector
    lm_head: Matrix


def read_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.field("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; tailguard's engine runs Llama-family models")
    tokens = gf.field("tokenizer.ggml.tokens") or []
    return ModelConfig(
        name=str(gf.field("general.name", "llama")),
        num_layers=int(gf.field("llama.block_count")),
        hidden_size=int(gf.field("llama.embedding_length")),
        intermediate_size=int(gf.field("llama.feed_forward_length")),
        num_heads=int(gf.field("llama.attention.head_count")),
        num_kv_heads=int(gf.field("llama.attention.head_count_kv")),
        vocab_size=int(gf.field("llama.vocab_size", len(tokens))),
        max_position=int(gf.field("llama.context_length")),
        rope_theta=float(gf.field("llama.rope.freq_base", 10000.0)),
        rms_eps=float(gf.field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in gf.tensors,
        bos_token_id=gf.field("tokenizer.ggml.bos_token_id"),
        eos_token_id=int(gf.field("tokenizer.ggml.eos_token_id")),
    )


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: rows (head, half, pair) -> (head, pair, half)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def permute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``permute`` (used to write test GGUF files the way the converter does)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """float32 values [shape] of a tensor's raw bytes (``raw`` is the reader's own array: a view of it is fine)."""
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.tensor_type))
    return np.ascontiguousarray(values.reshape(info.shape), dtype=np.float32)


def _packed(info: TensorInfo, raw: np.ndarray, n_heads: int | None) -> PackedMatrix:
    """A 2-D tensor kept in its GGUF block format (rows un-permuted as whole rows of blocks, which is exact), in the
    kernels' layout (Q4_1 repacked). Formats the kernels cannot read are dequantized to float32 rows instead.
    ``raw`` [rows, bytes a row] is owned by this call (read from the file, not mapped), so it is used in place."""
    n, k = info.shape
    fmt = info.tensor_type
    if fmt in NATIVE_FORMATS and (fmt in (F32, F16) or k % 32 == 0):
        rows = raw
    else:
        fmt = 0
        rows = _dequantize(info, raw).view(np.uint8).reshape(n, -1)
    if n_heads is not None:
        rows = np.ascontiguousarray(unpermute_qk(rows, n_heads))
    return _kernel_layout(PackedMatrix(rows, fmt, n, k))


def _cat_rows(parts: list[PackedMatrix]) -> PackedMatrix:
    """Stack matrices by rows (QKV, gate+up). Mixed formats fall back to float32 rows."""
    if len({p.fmt for p in parts}) > 1:
        parts = [PackedMatrix(p.dequantize().view(np.uint8), 0, p.out_features, p.in_features) for p in parts]
    return PackedMatrix(np.ascontiguousarray(np.concatenate([p.array for p in parts], axis=0)), parts[0].fmt,
                        sum(p.out_features for p in parts), parts[0].in_features)


def _kernel_layout(m: PackedMatrix) -> PackedMatrix:
    """The kernels' layout (kernels.kernel_layout): Q4_1 repacked (Q4_1R), or with int8 activations Q4_1 and Q8_0
    interleaved by 16-row groups (Q4_1X / Q8_0X). The same numbers; rows stay rows (in whole groups of 16), so
    concatenating these matrices by rows is still exact."""
    return kernel_layout(m)


def load_gguf(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
              packed: bool = False) -> ModelWeights:
    """Load a Llama GGUF. With ``packed`` the matrices keep the file's quantized blocks (for the native kernels) and
    the norms are float32 numpy arrays (no torch); otherwise every matrix and norm is a torch tensor of ``dtype``
    (float32 by default)."""
    gf = read_gguf(path)
    config = read_config(gf)
    with open(gf.path, "rb") as file:  # each tensor is read into its own array: nothing of the file stays mapped

        def get(name: str, n_heads: int | None = None) -> Vector:
            array = _dequantize(gf.tensor(name), gf.read(name, file))
            if n_heads is not None:
                array = np.ascontiguousarray(unpermute_qk(array, n_heads))
            if packed:
                return array
            import torch

            return torch.from_numpy(array).to(device=device, dtype=dtype or torch.float32)

        def matrix(name: str, n_heads: int | None = None) -> Matrix:
            return _packed(gf.tensor(name), gf.read(name, file), n_heads) if packed else get(name, n_heads)

        def cat(parts: list[Matrix]) -> Matrix:
            if packed:
                return _cat_rows(parts)
            import torch

            return torch.cat(parts, dim=0).contiguous()

        return _load_layers(config, get, matrix, cat)


def _load_layers(config: ModelConfig, get, matrix, cat) -> ModelWeights:
    """The weights of every layer, through the loader's ``get`` (norms), ``matrix`` and ``cat`` (fused rows)."""
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        q = matrix(p + "attn_q.weight", config.num_heads)
        k = matrix(p + "attn_k.weight", config.num_kv_heads)
        v = matrix(p + "attn_v.weight")
        layers.append(
            LayerWeights(
                attn_norm=get(p + "attn_norm.weight"),
                qkv=cat([q, k, v]),
                o=matrix(p + "attn_output.weight"),
                ffn_norm=get(p + "ffn_norm.weight"),
                gate_up=cat([matrix(p + "ffn_gate.weight"), matrix(p + "ffn_up.weight")]),
                down=matrix(p + "ffn_down.weight"),
            )
        )
    embed = matrix("token_embd.weight")
    lm_head = embed if config.tie_embeddings else matrix("output.weight")
    return ModelWeights(config=config, embed=embed, layers=layers, norm=get("output_norm.weight"), lm_head=lm_head)


def write_tiny_gguf(
    path: str | Path,
    tokenizer_source: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position: int = 2048,
    seed: int = 0,
    tie_embeddings: bool = True,
) -> Path:
    """Write a random-weight Llama GGUF that borrows the real model's tokenizer, for fast tests.

    The weights go through the same permutation as llama.cpp's converter, so the loader's un-permute is exercised.

    With tied embeddings (the default) the random model is close to an identity map: the last token's own embedding
    dominates its logits, so greedy decoding just repeats the last prompt token whatever the context. Tests that must
    see attention and the KV cache at work use ``tie_embeddings=False`` (a separate random ``output.weight``), which
    makes the greedy continuation depend on the whole context.
    """
    source = read_gguf(tokenizer_source)
    vocab_size = len(source.field("tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tailguard-tiny-random")
    writer.add_block_count(num_layers)
    writer.add_context_length(max_position)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    for key, value in source.metadata.items():
        if key.startswith("tokenizer."):
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
                writer.add_array(key, value)
            elif key == "tokenizer.ggml.token_type":
                writer.add_token_types(value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    head_dim = hidden_size // num_heads
    writer.add_tensor("token_embd.weight", rand(vocab_size, hidden_size, scale=0.5))
    for i in range(num_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", (1 + rand(hidden_size, scale=0.1)).astype(np.float32))
        writer.add_tensor(p + "attn_q.weight", permute_qk(rand(hidden_size, hidden_size), num_heads))
        writer.add_tensor(p + "attn_k.weight", permute_qk(rand(num_kv_heads * head_dim, hidden_size), num_kv_heads))
        writer.add_tensor(p + "attn_v.weight", rand(num_kv_heads * head_dim, hidden_size))
        writer.add_tensor(p + "attn_output.weight", rand(hidden_size, hidden_size))
        writer.add_tensor(p + "ffn_norm.weight", (1 + rand(hidden_size, scale=0.1)).astype(np.float32))
        writer.add_tensor(p + "ffn_gate.weight", rand(intermediate_size, hidden_size))
        writer.add_tensor(p + "ffn_up.weight", rand(intermediate_size, hidden_size))
        writer.add_tensor(p + "ffn_down.weight", rand(hidden_size, intermediate_size))
    writer.add_tensor("output_norm.weight", np.ones(hidden_size, dtype=np.float32))
    if not tie_embeddings:
        writer.add_tensor("output.weight", rand(vocab_size, hidden_size, scale=0.3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
