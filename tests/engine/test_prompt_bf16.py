"""Prompt rows of the C step on the CPU's matrix units (AMX, bfloat16): the tiles' layout, the numbers against the
block kernels', and a decode row's numbers unchanged by the prompt rows that share its step."""

from __future__ import annotations

import numpy as np
import pytest

from tailguard.engine import kernels
from tailguard.engine.blocks import BlockTable
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.scheduler import ScheduledChunk
from tailguard.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.skipif(not kernels.available() or not kernels.amx_available(),
                                reason="the CPU (or the OS) offers no AMX tiles")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its bfloat16 rounding (nearest even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)).view(np.float32)


def q8_0_matrix(n: int, k: int, seed: int) -> kernels.PackedMatrix:
    """A random Q8_0 matrix: per 32 weights a float16 scale, then 32 int8 values."""
    rng = np.random.default_rng(seed)
    rows = np.empty((n, k // 32, 34), dtype=np.uint8)
    rows[:, :, :2] = rng.uniform(0.01, 0.1, size=(n, k // 32)).astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
    rows[:, :, 2:] = rng.integers(-127, 128, size=(n, k // 32, 32)).astype(np.int8).view(np.uint8)
    return kernels.PackedMatrix(rows.reshape(n, -1), kernels.Q8_0, n, k)


def test_packed_tiles_hold_each_weight_rounded_where_the_tile_instruction_reads_it():
    w = q8_0_matrix(64, 96, seed=1)
    tiles = kernels.pack_bf16(w)
    assert tiles is not None and tiles.size == 64 * 96
    dense = np.asarray(w.dequantize())
    got = (tiles.astype(np.uint32) << 16).view(np.float32)
    for n, k in [(0, 0), (0, 1), (1, 0), (15, 31), (16, 32), (33, 63), (63, 95), (40, 70)]:
        tile = (n // 16) * (96 // 32) + k // 32  # tiles of 16 output rows x 32 inputs, inputs in pairs
        at = tile * 512 + ((k % 32) // 2) * 32 + (n % 16) * 2 + (k % 2)
        assert got[at] == to_bf16(dense[n, k]), (n, k)
    assert kernels.pack_bf16(q8_0_matrix(48, 96, seed=2)) is None  # 48 rows do not fill the 32-row blocks


def tiny_engine(monkeypatch, prompt_bf16: bool, model: str = "tiny") -> LLMEngine:
    """The tiny model (head_dim 16: attention stays row by row) or the real one (head_dim 64: attention on the tiles
    too)."""
    monkeypatch.setenv(kernels.PROMPT_BF16_ENV, "1" if prompt_bf16 else "0")
    engine = LLMEngine(EngineArgs(model=model, num_threads=2, enable_prefix_caching=False,
                                  kv_cache_memory="64MiB"))
    assert (engine.runner._step.bf16_bytes > 0) == prompt_bf16
    return engine


def sequences(engine) -> tuple[dict[str, BlockTable], Sequence, Sequence]:
    """A sequence whose 12-token prompt is in the cache, about to decode its 13th token, and a fresh 40-token prompt."""
    rng = np.random.default_rng(7)
    decoding = Sequence(request_id="d", prompt_token_ids=rng.integers(100, 40000, size=12).tolist(),
                        sampling=SamplingParams())
    prompt = Sequence(request_id="p", prompt_token_ids=rng.integers(100, 40000, size=40).tolist(),
                      sampling=SamplingParams())
    tables = {}
    for seq in (decoding, prompt):
        tables[seq.request_id] = BlockTable(engine.pool, seq.request_id)
        assert tables[seq.request_id].ensure(seq.num_tokens + 1)
    engine.runner.chunk_logits([ScheduledChunk(decoding, 0, 12)], tables)
    decoding.num_computed_tokens = 12
    decoding.output_token_ids.append(int(rng.integers(100, 40000)))
    return tables, decoding, prompt


def step(engine, tables, chunks) -> tuple[np.ndarray, int]:
    """Every row's logits, and how many rows are decodes."""
    ids, pos, slots, tabs, lens, _, decode_rows = engine.runner._build(chunks, tables)
    return engine.runner._step(ids, pos, slots, tabs, lens, None, decode_rows), decode_rows


@pytest.mark.parametrize("model", ["tiny", "smollm2"])  # smollm2: its MLP's prompt rows go through the fused path
def test_a_decode_row_is_the_same_beside_prompt_rows_on_the_matrix_units(monkeypatch, model):
    engine = tiny_engine(monkeypatch, prompt_bf16=True, model=model)
    tables, decoding, prompt = sequences(engine)
    alone, n = step(engine, tables, [ScheduledChunk(decoding, 12, 1)])
    beside, m = step(engine, tables, [ScheduledChunk(decoding, 12, 1), ScheduledChunk(prompt, 0, 40)])
    assert n == m == 1
    np.testing.assert_array_equal(beside[0], alone[0])


@pytest.mark.parametrize("chunks", [[40], [24, 16], [30, 10]], ids=["one chunk", "two on the tiles", "a short tail"])
def test_prompt_rows_on_the_matrix_units_stay_close_to_the_block_kernels(monkeypatch, chunks):
    """The real model: products and attention on the tiles (a chunk of 16 rows or more; shorter ones attend row by
    row), a later chunk attending to the keys an earlier one cached, beside a decode row."""
    logits = {}
    for bf16 in (False, True):
        engine = tiny_engine(monkeypatch, prompt_bf16=bf16, model="smollm2")
        tables, decoding, prompt = sequences(engine)
        rows, start = [], 0
        for n in chunks:
            out, decode_rows = step(engine, tables, [ScheduledChunk(decoding, 12, 1), ScheduledChunk(prompt, start, n)])
            assert decode_rows == 1
            rows.append(out[1:])
            start += n
            prompt.num_computed_tokens = start
        logits[bf16] = np.concatenate(rows)
    blocks, tiles = logits[False], logits[True]
    scale = float(np.abs(blocks).max())
    diff = np.abs(tiles - blocks).max(axis=1)
    assert float(diff.max()) > 0, "prompt rows did not go through the matrix units"
    assert float(diff.max()) <= 0.05 * scale, f"max |bf16 - blocks| {diff.max():.3g} vs max |logit| {scale:.3g}"
    agree = float((tiles.argmax(axis=1) == blocks.argmax(axis=1)).mean())
    assert agree >= 0.9, f"top-1 agreement {agree:.2f}"


@pytest.mark.parametrize("rows", [1, 17, 32, 100])
def test_the_tile_product_is_the_product_of_the_rounded_values(rows):
    """y = x W^T on the tiles equals the float64 product of x and W rounded to bfloat16 (sums kept in float32), for
    row counts that fill no tile, part of one, and several."""
    w = q8_0_matrix(64, 96, seed=5)
    tiles = kernels.pack_bf16(w)
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    got = kernels.linear_bf16(x, tiles, 64)
    want = to_bf16(x).astype(np.float64) @ to_bf16(np.asarray(w.dequantize())).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_a_long_k_cut_into_pieces_is_still_the_product_of_the_rounded_values():
    """K = 1,536 is summed in pieces that fit L1, the sums kept in float32 between them: the same product, added to
    y too; pack_bf16's tiles sit on 64-byte lines (multiplied in place, not copied)."""
    w = q8_0_matrix(64, 1536, seed=6)
    tiles = kernels.pack_bf16(w)
    assert tiles.ctypes.data % 64 == 0
    x = np.random.default_rng(8).standard_normal((100, 1536)).astype(np.float32)
    want = to_bf16(x).astype(np.float64) @ to_bf16(np.asarray(w.dequantize())).astype(np.float64).T
    atol = 1e-5 * float(np.abs(want).max())
    np.testing.assert_allclose(kernels.linear_bf16(x, tiles, 64), want, rtol=1e-5, atol=atol)
    base = np.random.default_rng(9).standard_normal((100, 64)).astype(np.float32)
    np.testing.assert_allclose(linear_bf16_raw(x, tiles, 64, base.copy()), base + want, rtol=1e-5, atol=atol)


def linear_bf16_raw(x: np.ndarray, tiles: np.ndarray, n: int, y: np.ndarray | None = None) -> np.ndarray:
    """tg_linear_bf16 on caller-placed arrays: y = x W^T, or y += x W^T when y is given."""
    acc = y is not None
    y = np.zeros((x.shape[0], n), dtype=np.float32) if y is None else y
    assert kernels.lib().tg_linear_bf16(x.ctypes.data, x.shape[0], x.shape[1], tiles.ctypes.data, n, y.ctypes.data,
                                        int(acc)) == 0
    return y


def placed(tiles: np.ndarray, offset_bytes: int) -> np.ndarray:
    """A copy of ``tiles`` starting ``offset_bytes`` past a 64-byte line."""
    raw = np.empty(tiles.size + 64, dtype=np.uint16)
    start = (-raw.ctypes.data % 64 + offset_bytes) // 2
    out = raw[start:start + tiles.size]
    out[:] = tiles
    assert out.ctypes.data % 64 == offset_bytes
    return out


def test_a_rows_tile_product_depends_on_its_own_values_only():
    """K = 1,536 puts 256 rows in a block: a row's numbers are the same in any block, at any T, whether the weight's
    tiles sit on 64-byte lines or not (then copied), and added to y as the product plus y."""
    w = q8_0_matrix(96, 1536, seed=11)
    tiles = kernels.pack_bf16(w)
    x = np.random.default_rng(4).standard_normal((300, 1536)).astype(np.float32)
    full = linear_bf16_raw(x, placed(tiles, 0), 96)
    for offset in (16, 48):
        np.testing.assert_array_equal(linear_bf16_raw(x, placed(tiles, offset), 96), full)
    for lo, hi in [(260, 300), (255, 258), (0, 1), (31, 64)]:
        np.testing.assert_array_equal(linear_bf16_raw(np.ascontiguousarray(x[lo:hi]), tiles, 96), full[lo:hi])
    base = np.random.default_rng(5).standard_normal((300, 96)).astype(np.float32)
    np.testing.assert_array_equal(linear_bf16_raw(x, tiles, 96, base.copy()), base + full)


def test_with_prompt_rows_on_the_tiles_long_prompts_stay_in_the_c_step(monkeypatch):
    """The hand-off to torch past 2,048 positions was for the block kernels, which read each key once per query row;
    on the tiles a chunk reads its keys once a layer, and the C step is faster at every length measured
    (benchmarks/prefill_handoff.py). So a long prompt never loads torch there; the block kernels keep the rule."""
    from tailguard.engine.kv_layout import NATIVE_PREFILL_MAX_CONTEXT

    blocks = tiny_engine(monkeypatch, prompt_bf16=False)
    assert blocks.runner.native_prefill_max_context == NATIVE_PREFILL_MAX_CONTEXT
    tiles = tiny_engine(monkeypatch, prompt_bf16=True, model="smollm2")  # (the tiny model's context is 2,048)
    assert tiles.runner.native_prefill_max_context == tiles.config.max_position > NATIVE_PREFILL_MAX_CONTEXT + 300
    prompt = np.random.default_rng(3).integers(100, 40000, size=NATIVE_PREFILL_MAX_CONTEXT + 300).tolist()
    out = tiles.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out) == 2 and tiles.runner._torch_runner is None  # every chunk in C: torch never loaded
