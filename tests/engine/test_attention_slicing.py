"""Attention slicing for long contexts (EngineArgs.attention_slice_tokens): decode attention over a long paged KV
in slices and prefill attention over a long cached prefix in key tiles, both merged by log-sum-exp, equal the
single-shot SDPA paths within float tolerance at 8K tokens (float32, float16 and int8 KV), never hold more than one
slice of keys at a time, and leave the engine's greedy outputs unchanged.

Shapes are SmolLM2-135M's attention (9 query heads over 3 KV heads of 64), on a paged cache whose block tables are
shuffled, so that a slice boundary never coincides with contiguous memory.
"""

from __future__ import annotations

import pytest
import torch

import tailguard.engine.torch_model as model_module
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams
from tailguard.engine.torch_model import AttentionMetadata, LlamaModel, prefill_attention_tiled, quantize_kv

N_HEADS, N_KV, HEAD_DIM = 9, 3, 64
BLOCK = 16
LONG = 8192
# float32 sums in a different order: observed differences are ~1e-6 on outputs of size ~0.1-1
ATOL, RTOL = 2e-5, 1e-4
KV_DTYPES = [torch.float32, torch.float16, torch.int8]


def _paged_cache(num_blocks: int, kv_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches [blocks, block, kv, row] holding random values stored as ``kv_dtype``.

    Keys get a per-head spread so that scores differ by several units: the softmax is peaked, as in a real model,
    and a slice that rescales its running maximum wrongly shows."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, BLOCK, N_KV, HEAD_DIM, generator=gen) * torch.tensor([0.5, 2.0, 4.0]).view(1, 1, 3, 1)
    v = torch.randn(num_blocks, BLOCK, N_KV, HEAD_DIM, generator=gen)
    if kv_dtype == torch.int8:
        return quantize_kv(k), quantize_kv(v)
    return k.to(kv_dtype), v.to(kv_dtype)


def _decode_meta(lengths: list[int], num_blocks: int, seed: int) -> AttentionMetadata:
    """Decode metadata as the runner builds it: shuffled block tables padded with block 0, a key mask, lengths."""
    gen = torch.Generator().manual_seed(seed)
    widest = -(-max(lengths) // BLOCK)
    perm = torch.randperm(num_blocks, generator=gen)
    tables, used = [], 0
    for n in lengths:
        blocks = -(-n // BLOCK)
        tables.append(perm[used : used + blocks].tolist() + [0] * (widest - blocks))
        used += blocks
    lens = torch.tensor(lengths, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long),
        positions=lens.long() - 1,
        num_decodes=len(lengths),
        decode_gather=torch.tensor(tables, dtype=torch.long),
        decode_mask=(torch.arange(widest * BLOCK).unsqueeze(0) < lens.unsqueeze(1)).view(len(lengths), 1, 1, -1),
        prefills=[],
        decode_lens=lens,
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_sliced_decode_equals_single_shot_at_8k(kv_dtype):
    lengths = [LONG, 1030, 17]  # one full 8K context beside shorter ones padded into the same batch
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 8
    k_cache, v_cache = _paged_cache(num_blocks, kv_dtype, seed=1)
    meta = _decode_meta(lengths, num_blocks, seed=2)
    q = torch.randn(len(lengths), N_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    whole = LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=0)
    for slice_tokens in (1024, 1000):  # 1000: rounded down to 62 whole blocks, the last slice a partial one
        sliced = LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=slice_tokens)
        assert sliced.shape == whole.shape
        assert torch.allclose(sliced, whole, atol=ATOL, rtol=RTOL), float((sliced - whole).abs().max())


def test_unfused_slices_equal_the_fused_kernel(monkeypatch):
    """The plain-torch slice (CUDA, or a torch without the CPU flash kernel) gives the same numbers at 8K."""
    lengths = [LONG, 700]
    num_blocks = sum(-(-n // BLOCK) for n in lengths)
    k_cache, v_cache = _paged_cache(num_blocks, torch.int8, seed=14)
    meta = _decode_meta(lengths, num_blocks, seed=15)
    q = torch.randn(2, N_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(16))
    pq, pk, pv, gather, mask = _prefill_case(torch.float32, start=LONG - 100, n=100)
    fused = (LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=1024),
             prefill_attention_tiled(pq, pk, pv, gather, mask, 1024))
    monkeypatch.setattr(model_module, "_FLASH_CPU", None)
    unfused = (LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=1024),
               prefill_attention_tiled(pq, pk, pv, gather, mask, 1024))
    whole = (LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=0),
             _prefill_single_shot(pq, pk, pv, gather, mask))
    for a, b, c in zip(fused, unfused, whole):
        assert torch.allclose(a, b, atol=ATOL, rtol=RTOL)
        assert torch.allclose(b, c, atol=ATOL, rtol=RTOL)


def test_sliced_decode_equals_float64_reference():
    """Both paths against attention computed in float64 from the same stored values: slicing adds no error."""
    lengths = [LONG, 300]
    num_blocks = sum(-(-n // BLOCK) for n in lengths)
    k_cache, v_cache = _paged_cache(num_blocks, torch.float32, seed=4)
    meta = _decode_meta(lengths, num_blocks, seed=5)
    q = torch.randn(2, N_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    sliced = LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=512)
    for d, n in enumerate(lengths):
        k = k_cache[meta.decode_gather[d]].flatten(0, 1)[:n].double()  # [n, kv, hd]
        v = v_cache[meta.decode_gather[d]].flatten(0, 1)[:n].double()
        for h in range(N_HEADS):
            g = h // (N_HEADS // N_KV)
            w = torch.softmax(k[:, g] @ q[d, h].double() / HEAD_DIM**0.5, dim=0)
            assert torch.allclose(sliced[d, h].double(), w @ v[:, g], atol=1e-5)


def _prefill_case(kv_dtype: torch.dtype, start: int, n: int):
    """A prefill chunk of n queries at positions start..start+n-1 over its sequence's cached keys (as the runner
    builds it: the used blocks and a causal mask with the chunk's offset)."""
    end = start + n
    blocks = -(-end // BLOCK)
    k_cache, v_cache = _paged_cache(blocks + 3, kv_dtype, seed=7)
    gather = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(8))[:blocks]
    mask = torch.arange(blocks * BLOCK).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    q = torch.randn(N_HEADS, n, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    return q, k_cache, v_cache, gather, mask


def _prefill_single_shot(q, k_cache, v_cache, gather, mask) -> torch.Tensor:
    # the forward's untiled path, written out: one gather and one masked SDPA
    k = model_module._kv_values(k_cache[gather], q.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
    v = model_module._kv_values(v_cache[gather], q.dtype).flatten(0, 1).transpose(0, 1).unsqueeze(0)
    out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(0), k, v, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=str)
def test_tiled_prefill_equals_single_shot_at_8k(kv_dtype):
    # the last 256-token chunk of an 8K prompt: its queries see 7936..8191 keys, the last tile only partly
    q, k_cache, v_cache, gather, mask = _prefill_case(kv_dtype, start=LONG - 256, n=256)
    whole = _prefill_single_shot(q, k_cache, v_cache, gather, mask)
    for slice_tokens in (1024, 160):
        tiled = prefill_attention_tiled(q, k_cache, v_cache, gather, mask, slice_tokens)
        assert torch.allclose(tiled, whole, atol=ATOL, rtol=RTOL), float((tiled - whole).abs().max())


def test_tiled_prefill_chunk_not_aligned_to_blocks_or_tiles():
    q, k_cache, v_cache, gather, mask = _prefill_case(torch.float32, start=1000, n=37)
    whole = _prefill_single_shot(q, k_cache, v_cache, gather, mask)
    tiled = prefill_attention_tiled(q, k_cache, v_cache, gather, mask, 64)
    assert torch.allclose(tiled, whole, atol=ATOL, rtol=RTOL)


class _SliceRecorder:
    """Wraps model.attention_sliced to record the key width of every slice it is handed (the slices are what the
    step materializes in float: K, V and the scores)."""

    def __init__(self, monkeypatch):
        self.calls: list[list[int]] = []
        real = model_module.attention_sliced

        def recording(q, slices):
            widths: list[int] = []
            self.calls.append(widths)

            def observed():
                for k, v, mask in slices:
                    widths.append(k.shape[-2])
                    yield k, v, mask

            return real(q, observed())

        monkeypatch.setattr(model_module, "attention_sliced", recording)


def test_decode_materializes_one_slice_at_a_time(monkeypatch):
    recorder = _SliceRecorder(monkeypatch)
    lengths = [LONG, 40]
    num_blocks = sum(-(-n // BLOCK) for n in lengths)
    k_cache, v_cache = _paged_cache(num_blocks, torch.int8, seed=10)
    meta = _decode_meta(lengths, num_blocks, seed=11)
    q = torch.randn(2, N_HEADS, HEAD_DIM)
    LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=1024)
    assert recorder.calls == [[1024] * 8]  # 8K keys in 8 slices of 1024, none wider
    recorder.calls.clear()
    LlamaModel._decode_attention(q, k_cache, v_cache, meta, slice_tokens=1000)
    assert recorder.calls == [[992] * 8 + [LONG - 992 * 8]]  # whole blocks: 62 of 16
    # a context that fits one slice keeps the single-shot SDPA path
    recorder.calls.clear()
    short = _decode_meta([40, 17], num_blocks, seed=12)
    LlamaModel._decode_attention(q, k_cache, v_cache, short, slice_tokens=1024)
    assert recorder.calls == []


def test_prefill_tiles_are_bounded(monkeypatch):
    recorder = _SliceRecorder(monkeypatch)
    q, k_cache, v_cache, gather, mask = _prefill_case(torch.float32, start=LONG - 256, n=256)
    prefill_attention_tiled(q, k_cache, v_cache, gather, mask, 2048)
    assert recorder.calls == [[2048] * 4]


# --- the engine ---------------------------------------------------------------------------------------------------

def _greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
           for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
    return [out[i] for i in ids]


@pytest.mark.parametrize("kv_cache_dtype", ["int8"])  # float32 and float16 KV: the direct tests above
def test_engine_greedy_outputs_identical_with_small_slices(tiny_gguf, monkeypatch, kv_cache_dtype):
    """Slices of 2 blocks against slicing off, on the tiny model with torch attention (float32 weights): prompts of
    a few hundred tokens prefilled in 48-token chunks (every chunk after the first tiled over its prefix) beside
    decoding streams (mixed steps), then decoded past many slices."""
    recorder = _SliceRecorder(monkeypatch)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (230, 150, 35)]
    results = {}
    for slice_tokens in (32, 0):
        recorder.calls.clear()
        engine = LLMEngine(EngineArgs(model=str(tiny_gguf), weight_format="float32", kv_cache_dtype=kv_cache_dtype,
                                      kv_cache_tokens=4096, max_num_batched_tokens=64, max_prefill_chunk=48,
                                      max_model_len=1024, num_threads=1, attention_slice_tokens=slice_tokens))
        results[slice_tokens] = _greedy_outputs(engine, prompts, max_tokens=16)
        assert engine.pool.num_used == 0
        widths = [w for call in recorder.calls for w in call]
        if slice_tokens:
            assert widths and max(widths) == 32  # slicing did run, in slices of 2 blocks
        else:
            assert widths == []  # off: the single-shot paths only
    assert results[32] == results[0]
    assert all(len(r) == 16 for r in results[0])


def test_negative_slice_size_is_refused():
    with pytest.raises(ValueError, match="attention_slice_tokens"):
        LLMEngine(EngineArgs(model="tiny", attention_slice_tokens=-1))


def test_the_slice_size_is_a_command_line_option():
    import argparse

    from tailguard.engine_options import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).attention_slice_tokens == 1024
    assert engine_args_from(parser.parse_args(["--attention-slice-tokens", "0"])).attention_slice_tokens == 0
