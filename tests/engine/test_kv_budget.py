"""The KV cache is sized from a memory budget, and the context never promises more than the cache holds."""

from __future__ import annotations

import pytest
import torch

from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.memory import available_bytes, parse_budget
from tailguard.engine.sequence import SamplingParams

CPU = torch.device("cpu")


@pytest.mark.parametrize("value, expected", [("1.5GiB", int(1.5 * 2**30)), ("800MB", 800 * 10**6), ("512 MiB", 512 * 2**20),
                                             (2e9, 2 * 10**9), ("1e3KiB", 1000 * 1024)])
def test_budgets_in_bytes(value, expected):
    assert parse_budget(value, CPU) == expected


def test_a_share_of_available_memory():
    share = parse_budget(0.1, CPU)
    assert 0 < share <= available_bytes(CPU) * 0.1 + 1


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "1.5 parsecs", "GiB"])
def test_a_bad_budget_says_what_it_takes(bad):
    with pytest.raises(ValueError, match="KV cache memory"):
        parse_budget(bad, CPU)


def test_capacity_is_derived_from_the_budget_and_bounds_the_context(tiny_gguf):
    # float16, tiny model (2 layers, 2 KV heads of 16): 256 bytes a token; 64 KiB hold 256 tokens = 16 blocks
    engine = LLMEngine(EngineArgs(model=str(tiny_gguf), kv_cache_memory="64KiB", kv_cache_dtype="float16",
                                  num_threads=1))
    assert engine.model.kv_bytes_per_token(engine.kv_dtype) == 2 * 2 * 2 * 16 * 2
    assert engine.kv_capacity_tokens == 256 and engine.pool.num_blocks == 16
    # The model's context is 2048 tokens; the engine promises only what the cache holds, so a request without
    # max_tokens (the server then asks for max_model_len - prompt) is served, not refused.
    assert engine.max_model_len == 256
    prompt = list(range(10, 40))
    out = engine.generate([prompt], SamplingParams(max_tokens=engine.max_model_len - len(prompt), temperature=0.0,
                                                   ignore_eos=True))
    assert len(out[0]) == 256 - 30
    assert "256 tokens" in engine.describe().replace(",", "")


def test_a_budget_too_small_for_one_block_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(EngineArgs(model=str(tiny_gguf), kv_cache_memory="1KiB", num_threads=1))
