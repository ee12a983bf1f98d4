"""Our engine against Hugging Face transformers: same GGUF, same prompt ids, greedy tokens must agree.

A token may differ only at a floating-point near-tie: where transformers' top-2 logits are less than TIE_MARGIN apart.
After such a position the two continuations are free to diverge, so our engine is restarted on transformers' prefix
(the prompt plus transformers' tokens up to and including the tie) and the comparison goes on from there. Every prompt
must have at least MIN_COMPARED_SHARE of its new tokens compared: a near-tie on the first token must not turn a
prompt's comparison into no comparison at all. Both the default (native) and the float32 weight formats are checked,
with a float32 KV cache like transformers' (the native runner for native): the default int8 KV cache rounds K and V, so
free-running greedy output may part from float32's at a small margin; its fidelity is judged by perplexity
(tests/engine/test_kv_int8.py, benchmarks/fidelity.py).
"""

from __future__ import annotations

import random

import pytest

from tailguard.engine.sequence import SamplingParams

# transformers' own deprecation notices (past_key_values, torch_dtype) are not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
TIE_MARGIN = 1e-3
MIN_COMPARED_SHARE = 0.75  # of the new tokens of each prompt (24 of 32: at most 8 near-ties)

QUESTIONS_ZH = [
    "中国的首都是哪里？",
    "请用一句话介绍一下长城。",
    "如何学习一门新的编程语言？",
    "写一首关于春天的短诗。",
    "为什么天空是蓝色的？",
]
QUESTIONS_EN = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for writing clean Python code.",
    "Write a haiku about the ocean.",
    "Why do cats purr?",
]


def load_hf_model(path):
    torch.set_num_threads(1)  # the forward passes are small; extra threads only fight over busy cores
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation (no stopping at EOS) and the top-2 logit margin at each position."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def compare(name: str, generate, prompt: list[int], theirs: list[int], margins: list[float],
            min_compared: int) -> tuple[str | None, str]:
    """Our greedy tokens against transformers' ``theirs`` (with its top-2 margins) for one prompt.

    ``generate(prefix, n)`` is our engine's greedy continuation of ``prefix`` by ``n`` tokens; it is called again on
    transformers' prefix after each near-tie. Returns (failure or None, a one-line report)."""
    n = len(theirs)
    compared, ties, start = 0, [], 0
    while start < n:
        ours = generate(prompt + theirs[:start], n - start)
        assert len(ours) == n - start, f"{name}: we produced {len(ours)} tokens, expected {n - start}"
        for offset, a in enumerate(ours):
            pos = start + offset
            if a == theirs[pos]:
                compared += 1
                continue
            where = (f"{name}: difference at new token {pos}: ours {a}, transformers {theirs[pos]}; "
                     f"HF top-2 margin {margins[pos]:.3g}")
            if margins[pos] >= TIE_MARGIN:
                return where + " -> NOT a near-tie", where + " -> NOT a near-tie"
            ties.append(pos)
            start = pos + 1  # restart on transformers' prefix, tie token included
            break
        else:
            break
    line = f"{name}: {compared} of {n} tokens compared and identical" + (f", near-ties at {ties}" if ties else "")
    if compared < min_compared:
        return f"{line}: fewer than the {min_compared} required", line
    return None, line


def run_comparison(engine, hf_tokens, prompts: dict[str, list[int]], n: int) -> None:
    names = list(prompts)
    sampling = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    # All prompts at once: continuous batching with chunked prefill, as in serving.
    first = dict(zip(names, engine.generate([prompts[k] for k in names], sampling)))

    def generate_for(name: str):
        def generate(prefix: list[int], count: int) -> list[int]:
            if prefix == prompts[name] and count == n:
                return first[name]
            return engine.generate([prefix], SamplingParams(max_tokens=count, temperature=0, ignore_eos=True))[0]
        return generate

    failures, lines = [], []
    for name in names:
        theirs, margins = hf_tokens(prompts[name], n)
        failure, line = compare(name, generate_for(name), prompts[name], theirs, margins, int(MIN_COMPARED_SHARE * n))
        lines.append(f"[{engine.weight_format}] {line}")
        if failure:
            failures.append(failure)
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


def cached_greedy(model):
    """hf_greedy with its results kept, so that each weight format compares against one transformers run."""
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def run(prompt: list[int], n: int):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, n)
        return cache[key]
    return run


# --- the comparison itself (no model): what counts as compared --------------------------------------------------


def test_a_near_tie_on_the_first_token_does_not_end_the_comparison():
    theirs = [5, 6, 7, 8]
    margins = [1e-5, 1.0, 1.0, 1.0]

    def generate(prefix, count):  # differs at the tie, then agrees from transformers' prefix on
        return [9, 6, 7, 8][-count:] if count == 4 else theirs[-count:]

    failure, line = compare("p", generate, [1, 2], theirs, margins, min_compared=3)
    assert failure is None and line.startswith("p: 3 of 4 tokens compared"), line


def test_too_few_compared_tokens_fail_the_prompt():
    theirs = [5, 6, 7, 8]

    def always_different(prefix, count):
        return [t + 1 for t in theirs[-count:]]

    failure, _ = compare("p", always_different, [1, 2], theirs, [1e-5] * 4, min_compared=1)
    assert failure is not None and "fewer than the 1 required" in failure
    failure, _ = compare("p", always_different, [1, 2], theirs, [1.0] * 4, min_compared=1)
    assert failure is not None and "NOT a near-tie" in failure


# --- the tiny random model (fast; catches loader and attention bugs without the real weights) ---------------------


@pytest.fixture(scope="module")
def hf_tiny_tokens(tiny_gguf):
    return cached_greedy(load_hf_model(tiny_gguf))


@pytest.fixture(scope="module")
def tiny_float32_engine(tiny_gguf):
    from tailguard.engine.engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model=str(tiny_gguf), weight_format="float32", kv_cache_tokens=16384, max_num_seqs=32,
                                max_num_batched_tokens=64, max_prefill_chunk=48, max_model_len=512, num_threads=1))


@pytest.mark.parametrize("fmt", ["native", "float32"])
def test_tiny_model_greedy_matches_transformers(fmt, _tiny_engine_session, tiny_float32_engine, hf_tiny_tokens):
    engine = _tiny_engine_session if fmt == "native" else tiny_float32_engine
    assert engine.weight_format == fmt
    rng = random.Random(11)
    prompts = {f"random-{i}": [rng.randrange(100, 49000) for _ in range(rng.randint(2, 120))] for i in range(6)}
    run_comparison(engine, hf_tiny_tokens, prompts, 24)


# --- the real SmolLM2-135M-Instruct ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_real_tokens(smollm2_path):
    return cached_greedy(load_hf_model(smollm2_path))


@pytest.fixture(scope="module")
def real_float32_engine(smollm2_path):
    from tailguard.engine.engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model="smollm2", weight_format="float32", kv_cache_tokens=4096,
                                max_num_batched_tokens=256, max_prefill_chunk=128, num_threads=1))


@pytest.fixture(scope="module")
def real_native_engine(smollm2_path):
    from tailguard.engine.engine import EngineArgs, LLMEngine

    return LLMEngine(EngineArgs(model="smollm2", kv_cache_dtype="float32", kv_cache_tokens=4096,
                                max_num_batched_tokens=256, max_prefill_chunk=128, num_threads=1))


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["native", "float32"])
def test_real_model_greedy_matches_transformers(fmt, real_native_engine, real_float32_engine, tokenizer,
                                                hf_real_tokens):
    engine = real_native_engine if fmt == "native" else real_float32_engine
    assert engine.weight_format == fmt and (fmt != "native" or engine.native)
    prompts = {
        q: tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS_ZH + QUESTIONS_EN
    }
    assert sum(len(p) for p in prompts.values()) > engine.args.max_num_batched_tokens, (
        "the prompts should need several steps to prefill, so that prefill chunks mix with decodes"
    )
    run_comparison(engine, hf_real_tokens, prompts, NEW_TOKENS)


@pytest.mark.real_model
def test_real_model_knows_the_capital_of_france(real_engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = real_engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0]
    text = tokenizer.decode(out)
    assert "Paris" in text, text
