"""``decode_rows_on_tiles``: a step with at least that many decode rows runs them with its prompt rows on the matrix
units. The C step reads the split from the runner (rows before it through the block kernels), so the option is the
runner telling it 0 decode rows; off, decode rows keep the block kernels at every batch size."""

from __future__ import annotations

import numpy as np
import pytest

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native runner runs tailguard's kernels (gcc)")


def run(path, rows_on_tiles: int, prompts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The decode-row count each C step was told, and each prompt's greedy tokens."""
    eng = LLMEngine(EngineArgs(model=str(path), kv_cache_tokens=4096, num_threads=1, max_num_batched_tokens=256,
                               decode_rows_on_tiles=rows_on_tiles))
    told: list[int] = []
    step = eng.runner._step

    def spy(*args):
        told.append(int(args[-1]))
        return step(*args)

    eng.runner._step = spy
    outs = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return told, [list(o) for o in outs]


def test_decode_rows_go_to_the_tiles_only_from_the_configured_count(tiny_gguf):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(100, 49000, size=20).tolist() for _ in range(3)]
    told_off, tokens_off = run(tiny_gguf, 0, prompts)
    told_on, tokens_on = run(tiny_gguf, 3, prompts)
    assert max(told_off) == 3  # three streams decode together: three decode rows
    assert 3 not in told_on and 0 in told_on  # with three or more they are told as none (every row a tile row)
    assert told_on.count(0) >= told_off.count(0) + 4  # the five decode steps of three streams
    one, _ = run(tiny_gguf, 3, prompts[:1])
    assert 1 in one and 0 not in one[1:]  # one stream alone keeps the block kernels
    if not kernels.prompt_rows_bf16():
        assert tokens_on == tokens_off  # no tiles here: the C step runs the block kernels whatever it is told
