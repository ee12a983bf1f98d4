"""What keeps the server's resident set small (issue 8): the GGUF file is read, not mapped, and by a reader that gives
the same values as the gguf package's; the native model holds no float copy of a matrix; decode rows attend in groups
whose numbers equal the whole batch's; large freed blocks go back to the OS; the server's default KV cache (float16,
1.5 GiB) and the int8 memory setting (768 MiB) each hold 32 conversations of 2K tokens."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import tailguard.engine.torch_model as model_module
from tailguard.engine.gguf_file import GGUFFormatError, read_gguf
from tailguard.engine.kernels import PackedMatrix
from tailguard.engine.loader import load_gguf
from tailguard.engine.torch_model import AttentionMetadata, LlamaModel, quantize_kv


def _mapped_paths() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}


def test_the_lean_reader_gives_what_the_gguf_package_reads(tiny_gguf):
    ours = read_gguf(tiny_gguf)
    reference = gguf.GGUFReader(str(tiny_gguf))
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        expected = field.contents()
        if isinstance(expected, float):
            assert ours.metadata[key] == pytest.approx(expected), key
        else:
            assert ours.metadata[key] == expected, key
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for t in reference.tensors:
        raw = ours.read(t.name)
        assert ours.tensors[t.name].shape == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(np.asarray(t.data).view(np.uint8).reshape(raw.shape), raw), t.name
        owner = raw if raw.base is None else raw.base
        assert owner.flags.owndata  # read into memory of its own, not a view of a mapping


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf(bad)
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(truncated)


def test_no_mapping_of_the_model_file_remains_after_loading(smollm2_path):
    weights = load_gguf(smollm2_path, packed=True)
    model = LlamaModel(weights, "native")
    assert str(smollm2_path.resolve()) not in _mapped_paths()
    assert model.weight_bytes() > 50 * 2**20  # the weights themselves are there, in memory of their own


def test_the_native_model_holds_no_float_copy_of_a_matrix(smollm2_path):
    model = LlamaModel(load_gguf(smollm2_path, packed=True), "native")
    cfg = model.config
    float_bytes = 0
    for value in [model.embed, model.norm, model.cos, model.sin, *(t for layer in model.layers for t in layer)]:
        tensors = [value] if isinstance(value, torch.Tensor) else []
        if isinstance(value, model_module.Linear):
            assert value.weight is None and isinstance(value.packed, PackedMatrix)
            tensors = [torch.from_numpy(value.packed.array)]
        float_bytes += sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point())
    assert model.lm_head.weight is None and model.lm_head.packed is not None
    # float tensors: the norms (hidden each) and the RoPE tables (max_position x head_dim, two of them), nothing else
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    rope = 2 * cfg.max_position * cfg.head_dim * 4
    assert float_bytes == norms + rope


def _decode_meta(lengths: list[int], num_blocks: int, block: int, seed: int) -> AttentionMetadata:
    gen = torch.Generator().manual_seed(seed)
    widest = -(-max(lengths) // block)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in lengths:
        blocks = -(-n // block)
        tables.append(perm[used : used + blocks].tolist() + [0] * (widest - blocks))
        used += blocks
    lens = torch.tensor(lengths, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long), positions=lens.long() - 1,
        num_decodes=len(lengths), decode_gather=torch.tensor(tables, dtype=torch.long),
        decode_mask=(torch.arange(widest * block).unsqueeze(0) < lens.unsqueeze(1)).view(len(lengths), 1, 1, -1),
        prefills=[], decode_lens=lens)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float16], ids=str)
@pytest.mark.parametrize("slice_tokens", [0, 256])
def test_grouped_decode_attention_equals_the_whole_batch(monkeypatch, kv_dtype, slice_tokens):
    # One thread, as the engines of this suite run: with more, torch's CPU attention may split a small batch's keys
    # across threads, and the float sums then differ in the last bits between a group and the whole batch. (Earlier
    # the suite's engines left torch at one thread for every later test; the native runner sets only OpenMP's count.)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _grouped_equals_whole(monkeypatch, kv_dtype, slice_tokens)
    finally:
        torch.set_num_threads(threads)


def _grouped_equals_whole(monkeypatch, kv_dtype, slice_tokens):
    n_heads, n_kv, head_dim, block = 9, 3, 64, 16
    lengths = [700, 33, 512, 17, 1000, 256, 129, 640, 5, 999, 300]
    num_blocks = sum(-(-n // block) for n in lengths) + 4
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, block, n_kv, head_dim, generator=gen) * 2
    v = torch.randn(num_blocks, block, n_kv, head_dim, generator=gen)
    k_cache, v_cache = (quantize_kv(k), quantize_kv(v)) if kv_dtype == torch.int8 else (k.half(), v.half())
    meta = _decode_meta(lengths, num_blocks, block, seed=1)
    q = torch.randn(len(lengths), n_heads, head_dim, generator=gen)
    widest = meta.decode_gather.shape[1] * block

    def attend(group_rows: int | None) -> torch.Tensor:
        keys = 10**9 if group_rows is None else group_rows * min(widest, slice_tokens or widest)
        monkeypatch.setattr(model_module, "DECODE_ATTENTION_GROUP_KEYS", keys)
        return LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens)

    whole, grouped = attend(None), attend(3)
    if slice_tokens == 0 or model_module._FLASH_CPU is None:
        assert torch.equal(whole, grouped)
    else:
        # torch's fused CPU flash kernel (the sliced path) is not batch-invariant to the last bit: seen 1 ulp (6e-8)
        # on one row, the kind of difference any change in the step's batch already makes
        torch.testing.assert_close(grouped, whole, atol=5e-7, rtol=0)
        monkeypatch.setattr(model_module, "_FLASH_CPU", None)  # the unfused slices: exactly equal
        assert torch.equal(attend(None), attend(3))


_HEAP_PROBE = """
import re, sys, torch
from tailguard.engine.memory import bound_heap_retention
assert bound_heap_retention()
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
big = torch.ones(4 << 20)  # freeing a mapped block is what raised glibc's dynamic threshold
del big
before = rss()
keep, scratch = [], []
for i in range(64):  # 4 MiB buffers interleaved with small blocks that live on, as in a prefill step
    scratch.append(torch.ones(1 << 20))
    keep.append(torch.ones(64))
peak = rss()
del scratch
print(before, peak, rss())
"""


def test_large_freed_blocks_go_back_to_the_os():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE], capture_output=True, text=True, check=True).stdout
    before, peak, after = (float(x) for x in out.split())
    assert peak - before > 200  # the 256 MiB of scratch was resident
    assert after - before < 32  # and went back when freed, although small blocks sat between the buffers


def test_the_default_server_kv_cache_holds_32_conversations_of_2k_in_int8_and_float16_in_twice_the_budget(
        smollm2_path):
    from tailguard.cli import build_parser
    from tailguard.engine.engine import DEFAULT_KV_MEMORY, kv_dtype_name
    from tailguard.engine.kv_layout import kv_row_bytes
    from tailguard.engine.loader import read_config
    from tailguard.engine.memory import parse_budget
    from tailguard.engine_options import engine_args_from

    args = engine_args_from(build_parser().parse_args(["serve"]))
    assert (args.kv_cache_dtype, args.kv_cache_memory, args.runner) == ("auto", "auto", "auto")
    cfg = read_config(read_gguf(smollm2_path))
    # native weights (the CPU default): int8 rows turned by a Hadamard transform; float16 for the other formats
    assert kv_dtype_name("auto", "native", cfg.head_dim) == "int8"
    assert kv_dtype_name("auto", "bfloat16", cfg.head_dim) == "float16"
    assert kv_dtype_name("auto", "native", 80) == "float16"  # no Hadamard rotation of 80: not the default

    def tokens_in(budget: str, dtype: str) -> int:
        per_token = cfg.num_layers * 2 * cfg.num_kv_heads * kv_row_bytes(dtype, cfg.head_dim)
        return parse_budget(budget, torch.device("cpu")) // (per_token * args.block_size) * args.block_size

    # room for 32 full 2K conversations, and not much more to grow into, whichever dtype auto picks
    for dtype in ("int8", "float16"):
        assert 32 * 2048 <= tokens_in(DEFAULT_KV_MEMORY[dtype], dtype) < 40 * 2048
    assert parse_budget(DEFAULT_KV_MEMORY["int8"], torch.device("cpu")) * 2 == parse_budget(
        DEFAULT_KV_MEMORY["float16"], torch.device("cpu"))
