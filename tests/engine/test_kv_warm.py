"""Warming the KV cache ahead of demand: the block pool knows which blocks were never handed out, the engine makes the
next of them resident while idle (their pages then fault before a prompt's step, not during it), and nothing that was
ever handed out is written."""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import time

import numpy as np
import pytest

from tailguard.engine.blocks import BlockPool
from tailguard.engine.engine import AsyncLLMEngine
from tailguard.engine.sequence import SamplingParams
from tests.conftest import _make_engine

_libc = ctypes.CDLL(None, use_errno=True)
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident(addr: int) -> bool:
    """Whether the page holding ``addr`` is in memory (mincore)."""
    vec = (ctypes.c_ubyte * 1)()
    start = addr // PAGE * PAGE
    assert _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(PAGE), vec) == 0, os.strerror(ctypes.get_errno())
    return bool(vec[0] & 1)


def block_addr(kv: np.ndarray, block: int, layer: int = 0, kv_index: int = 0) -> int:
    return kv.ctypes.data + layer * kv.strides[0] + kv_index * kv.strides[1] + block * kv.strides[2]


def test_fresh_from_is_the_first_block_never_handed_out_whatever_the_pool_went_through():
    rng = random.Random(7)
    pool = BlockPool(64, 4)
    ever: set[int] = set()
    held: dict[str, list[int]] = {}
    reused_with_fresh_left = 0  # allocations that took a used block while never-used ones remained
    for i in range(2000):
        op = rng.random()
        if op < 0.45 and pool.num_free:
            owner = f"r{i}"
            held[owner] = pool.allocate(rng.randint(1, min(6, pool.num_free)), owner)
            reused_with_fresh_left += bool(ever & set(held[owner])) and len(ever) < pool.num_blocks
            ever.update(held[owner])
        elif op < 0.85 and held:
            owner = rng.choice(sorted(held))
            blocks = held.pop(owner)
            for b in blocks:
                if rng.random() < 0.5:
                    pool.register(b, f"h{b}-{i}".encode())
            pool.free(blocks, owner)
        elif op < 0.9:
            pool.reset_cache()
        fresh = pool.fresh_from
        assert fresh == (max(ever) + 1 if ever else 0)
        assert not ever & set(range(fresh, pool.num_blocks))
    assert reused_with_fresh_left >= 5  # the test went through reuse, not only fresh blocks


@pytest.fixture
def warm_engine(tiny_gguf):
    return _make_engine(tiny_gguf, kv_cache_tokens=16384, kv_cache_dtype="int8")


def test_warming_makes_the_next_blocks_resident_and_leaves_every_used_block_as_it_was(warm_engine):
    engine = warm_engine
    kv = engine.runner.kv_cache
    prompt = list(range(5, 120))
    greedy = SamplingParams(max_tokens=8, temperature=0)
    first = engine.generate([prompt], greedy)[0]
    fresh = engine.pool.fresh_from
    assert fresh > 0
    used = kv[:, :, :fresh].copy()
    window = engine._kv_warm_ahead
    assert fresh + window < engine.pool.num_blocks
    inside, beyond = fresh + window - 1, fresh + 2 * window
    assert block_addr(kv, inside) // PAGE != block_addr(kv, fresh) // PAGE  # the window spans several pages
    assert not resident(block_addr(kv, inside)) and not resident(block_addr(kv, inside, layer=1, kv_index=1))

    calls = 0
    while engine.warm_kv(16):
        calls += 1
    assert calls == -(-window // 16)  # a bounded piece at a time, then done
    block_bytes = kv[:, :, :1].nbytes
    assert engine._kv_warm_piece == max(1, (3 << 20) // block_bytes)  # by default, 3 MiB a piece
    assert resident(block_addr(kv, inside)) and resident(block_addr(kv, inside, layer=1, kv_index=1))
    assert not resident(block_addr(kv, beyond))  # the window, not the whole cache
    assert np.array_equal(kv[:, :, :fresh], used)
    assert not kv[:, :, fresh:].any()
    assert not engine.warm_kv()  # nothing more until the pool hands out fresh blocks

    again = engine.generate([prompt], greedy)[0]  # the cached prefix survived the warming
    assert again == first
    engine.generate([list(range(200, 700))], SamplingParams(max_tokens=1, temperature=0))
    assert engine.pool.fresh_from > fresh
    assert engine.warm_kv()  # the window moved with the pool


def test_an_idle_server_engine_warms_its_kv_cache_and_still_serves(warm_engine):
    engine = warm_engine
    front = AsyncLLMEngine(engine)
    try:
        target = min(engine.pool.num_blocks, engine.pool.fresh_from + engine._kv_warm_ahead)
        deadline = time.monotonic() + 30
        while engine._kv_warm_to < target and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine._kv_warm_to == target
        assert resident(block_addr(engine.runner.kv_cache, target - 1))

        async def one() -> int:
            n = 0
            async for event in front.generate(list(range(10, 60)), SamplingParams(max_tokens=5, temperature=0),
                                              "warm-1"):
                n += event.token_id is not None
            return n

        assert asyncio.run(asyncio.wait_for(one(), 30)) == 5
    finally:
        front.shutdown()


def test_a_warmed_engines_prompt_steps_take_almost_no_page_faults(real_engine):
    """The C step keeps its buffers from step to step and warm_kv made the KV pages resident: a fresh prompt's steps
    then fault almost nothing in (each of them took ~2,000 faults in its buffers alone when they were fresh)."""
    import resource

    rng = np.random.default_rng(3)
    one = SamplingParams(max_tokens=1, temperature=0)
    real_engine.generate([rng.integers(100, 40000, size=256).tolist()], one)  # the buffers reach their size
    while real_engine.warm_kv():
        pass
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    real_engine.generate([rng.integers(100, 40000, size=256).tolist()], one)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 400, faults


def test_a_large_step_budget_warms_at_most_an_eighth_of_the_cache(tiny_gguf):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=8192, max_num_batched_tokens=4096, max_prefill_chunk=512)
    while engine.warm_kv():
        pass
    pool = engine.pool
    assert engine._kv_warm_to - pool.fresh_from == pool.num_blocks // 8  # not two steps' 8,192 tokens: the whole cache


def test_the_warm_window_follows_a_step_budget_changed_at_run_time(tiny_gguf):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=65536, max_num_batched_tokens=512, max_prefill_chunk=512)
    pool = engine.pool
    while engine.warm_kv():
        pass
    assert engine._kv_warm_to - pool.fresh_from == pool.blocks_for(2048)  # the floor: 2,048 tokens
    engine.set_caps(64, 3072)
    assert engine.warm_kv()  # a larger budget: more to warm
    while engine.warm_kv():
        pass
    assert engine._kv_warm_to - pool.fresh_from == pool.blocks_for(2 * 3072)
    engine.set_caps(64, 256)
    assert not engine.warm_kv()  # a smaller budget warms nothing more (what is warm stays warm)


def test_a_separate_draft_models_cache_is_warmed_over_the_same_blocks(tiny_gguf):
    engine = _make_engine(tiny_gguf, kv_cache_tokens=16384, kv_cache_dtype="int8", speculative=f"draft:{tiny_gguf}",
                          num_speculative_tokens=3)
    draft_kv = engine.speculation.proposer.runner.kv_cache
    assert draft_kv.data_ptr() != engine.runner.kv_cache.data_ptr()  # its own cache, not a view of the target's
    first = engine.pool.fresh_from
    last = first + engine._kv_warm_ahead - 1
    addr = draft_kv.data_ptr() + last * draft_kv.stride(2) * draft_kv.element_size()
    assert not resident(addr)
    while engine.warm_kv():
        pass
    assert resident(addr)
    assert not draft_kv.any()  # zeros, as never-used blocks read
