"""The native runner (engine/native_runner.py): the C step hosted by numpy, so that a serving process never imports torch.

It must give what the torch runner gives (the same C step, the same RoPE tables, the same KV format), hand the steps it
does not take (prefill chunks past NATIVE_PREFILL_MAX_CONTEXT) to torch over the same cache memory, and sample by the
same rules.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tailguard.engine import kernels
from tailguard.engine.engine import EngineArgs, LLMEngine
from tailguard.engine.native_runner import NativeRunner
from tailguard.engine.sampling import log_softmax, probabilities
from tailguard.engine.sequence import SamplingParams, Sequence
from tailguard.engine.torch_runner import ModelRunner

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the native runner runs tailguard's kernels (gcc)")


def _engine(path, runner: str, kv: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(path), runner=runner, kv_cache_dtype=kv, kv_cache_tokens=2048,
                                num_threads=1, max_num_batched_tokens=64, max_prefill_chunk=48, **kw))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 49000, size=int(rng.integers(5, 90))).tolist() for _ in range(n)]


def test_the_engine_picks_the_lean_runner_where_it_can(tiny_gguf):
    assert isinstance(_engine(tiny_gguf, "auto", "auto").runner, NativeRunner)
    assert isinstance(_engine(tiny_gguf, "torch", "auto").runner, ModelRunner)
    assert isinstance(_engine(tiny_gguf, "auto", "auto", speculative="ngram").runner, ModelRunner)
    with pytest.raises(ValueError, match="native runner needs"):
        _engine(tiny_gguf, "native", "auto", weight_format="float32")
    with pytest.raises(ValueError, match="runner must be one of"):
        _engine(tiny_gguf, "fast", "auto")


@pytest.mark.parametrize("kv", ["int8", "float16"])
def test_lean_and_torch_runners_give_the_same_tokens(tiny_gguf, kv):
    """Greedy continuations of a batch of prompts (chunked prefills sharing steps with decodes): token for token the
    same, because both runners call the same C step with the same arrays."""
    prompts = _prompts(6, seed=1)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    lean, ref = _engine(tiny_gguf, "native", kv), _engine(tiny_gguf, "torch", kv)
    assert lean.generate(prompts, sp) == ref.generate(prompts, sp)
    assert lean.pool.num_used == ref.pool.num_used == 0


def test_logits_and_logprobs_match_the_torch_runner(tiny_gguf):
    prompt = _prompts(1, seed=2)[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    got = {}
    for runner in ("native", "torch"):
        engine = _engine(tiny_gguf, runner, "int8")
        rid = engine.add_request(prompt, SamplingParams(**vars(sp)))
        events = []
        while engine.has_unfinished():
            events += [e for e in engine.step() if e.request_id == rid and e.token_id is not None]
        got[runner] = [(e.token_id, e.logprob, e.top_logprobs) for e in events]
    assert [t[0] for t in got["native"]] == [t[0] for t in got["torch"]] and len(got["native"]) == 4
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(got["native"], got["torch"]):
        assert abs(lp_a - lp_b) <= 1e-4
        assert [i for i, _ in top_a] == [i for i, _ in top_b] and len(top_a) == 3
        assert all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(top_a, top_b))


def test_a_step_past_the_c_limit_runs_in_torch_over_the_same_cache(tiny_gguf):
    """With the C step's prefill limit lowered to 32 positions, a 90-token prompt's later chunks run in torch's
    attention (torch loaded then, once), its decodes in C again, reading what torch wrote: the tokens of the torch
    runner with the same limit."""
    prompt = _prompts(1, seed=3)[0][:5] + list(range(1000, 1085))
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    lean, ref = _engine(tiny_gguf, "native", "int8"), _engine(tiny_gguf, "torch", "int8")
    lean.runner.native_prefill_max_context = ref.runner.native_prefill_max_context = 32
    assert not lean.runner.torch_loaded
    model = lean.runner.torch_runner().model
    forward, torch_steps = model.forward, []

    def counting(input_ids, meta, *args, **kwargs):
        torch_steps.append(bool(meta.prefills))  # prefill spans: the chunk's attention ran in torch, not in C
        return forward(input_ids, meta, *args, **kwargs)

    model.forward = counting
    assert lean.generate([prompt], sp) == ref.generate([prompt], sp)
    assert torch_steps and all(torch_steps)  # every handed-over step ran torch's attention
    assert lean.runner.torch_runner().kv_cache.data_ptr() == lean.runner.kv_cache.ctypes.data  # one cache, shared


def test_a_seeded_request_draws_the_same_tokens_whoever_shares_its_steps(tiny_gguf):
    """A step handed to torch (another request's prompt past the C limit) gives only its logits: the seeded request's
    tokens still come from its own numpy generator, the same as when it runs alone."""
    prompt = _prompts(1, seed=5)[0][:20]
    long_prompt = list(range(2000, 2200))
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = _engine(tiny_gguf, "native", "int8")
    alone.runner.native_prefill_max_context = 32
    expected = alone.generate([prompt], sp)[0]
    shared = _engine(tiny_gguf, "native", "int8")
    shared.runner.native_prefill_max_context = 32
    rid = shared.add_request(prompt, SamplingParams(**vars(sp)))
    out: list[int] = []
    for step in range(200):
        if step == 3:
            shared.add_request(long_prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        out += [e.token_id for e in shared.step() if e.request_id == rid and e.token_id is not None]
        if not shared.has_unfinished():
            break
    assert shared.runner.torch_loaded  # the long prompt's chunks did go through torch beside the seeded request
    assert out == expected


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.5, 20, 0.8)])
def test_the_numpy_sampler_draws_from_the_torch_runners_distribution(temperature, top_k, top_p):
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 3
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = probabilities(logits.numpy(), sp)
    theirs = ModelRunner._probs(logits, sp).double().numpy()
    assert abs(ours.sum() - 1) < 1e-9
    assert np.abs(ours - theirs).max() <= 1e-6
    assert np.array_equal(ours > 0, theirs > 0)
    assert np.allclose(log_softmax(logits.numpy()), torch.log_softmax(logits, -1).numpy(), atol=1e-5)


def test_seeded_sampling_repeats_and_min_tokens_holds_back_the_stop_token(tiny_gguf):
    engine = _engine(tiny_gguf, "native", "auto")
    prompt = _prompts(1, seed=4)[0]
    runs = [engine.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True))[0]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    # the sampler alone, on a row whose argmax is a stop token: held back until min_tokens
    seq = Sequence(request_id="s", prompt_token_ids=prompt,
                   sampling=SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]))
    row = np.zeros((1, 50), dtype=np.float32)
    row[0, 7], row[0, 9] = 5.0, 4.0
    sampler = engine.runner.sampler
    assert sampler.sample(row, [seq], set())[0].token_id == 9
    seq.output_token_ids.extend([1, 2, 3])
    assert sampler.sample(row, [seq], set())[0].token_id == 7


def test_a_serving_process_never_imports_torch(tiny_gguf):
    """The engine, the server's modules and a few requests (greedy, sampled, with logprobs): torch stays unloaded."""
    code = textwrap.dedent(f"""
        import sys
        import tailguard.cli, tailguard.serving.app
        from tailguard.engine.engine import EngineArgs, LLMEngine
        from tailguard.engine.sequence import SamplingParams
        e = LLMEngine(EngineArgs(model={str(tiny_gguf)!r}, kv_cache_tokens=1024))
        e.generate([[5, 6, 7], list(range(100, 160))], SamplingParams(max_tokens=5, temperature=0.0))
        e.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.9, seed=1, logprobs=2))
        print("torch" in sys.modules, e.native)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_tokens_and_logprobs_do_not_depend_on_the_thread_pool_or_count(tiny_gguf):
    """Prefill chunks and decodes of a batch with 1 and 2 threads, on the kernels' own pool (dynamic chunks) and on
    OpenMP's (static shares): every row is computed whole by one thread, so the numbers are the same bits."""
    prompts = _prompts(5, seed=6)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = _engine(tiny_gguf, "native", "int8")
    loaded = kernels.thread_settings_loaded()

    def run() -> list:
        ids = [engine.add_request(p, SamplingParams(**vars(sp))) for p in prompts]
        events = []
        while engine.has_unfinished():
            events += [(e.request_id, e.token_id, e.logprob, e.top_logprobs) for e in engine.step()
                       if e.token_id is not None]
        return [[ev[1:] for ev in events if ev[0] == rid] for rid in ids]

    try:
        results, loops = [], []
        for pool, threads in (("tailguard", 1), ("tailguard", 2), ("openmp", 2)):
            kernels.set_thread_pool(pool)
            kernels.set_num_threads(threads)
            engine.runner._threads_set_for = None  # OpenMP's count is per thread: let the runner apply it again
            engine.runner.num_threads = threads
            before = kernels.thread_stats()["loops"]
            results.append(run())
            loops.append(kernels.thread_stats()["loops"] - before)
    finally:
        kernels.set_thread_pool(loaded.pool)
        kernels.set_num_threads(1)
    assert results[0] == results[1] == results[2]
    assert all(len(r) == 10 for r in results[0])
    assert loops[0] == 0 and loops[1] > 0 and loops[2] == 0  # the two-thread own-pool run did share its loops
