"""Our engine against Hugging Face transformers: same GGUF, same prompt ids, greedy tokens must agree.

A token may differ only at a floating-point near-tie: where transformers' top-2 logits are less than TIE_MARGIN apart.
After such a position the two continuations are free to diverge, so comparison of that prompt stops there.
"""

from __future__ import annotations

import random

import pytest

from tailguard.engine.request import SamplingParams

# transformers' own deprecation notices (past_key_values, torch_dtype) are not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
TIE_MARGIN = 1e-3

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


def compare(name: str, ours: list[int], theirs: list[int], margins: list[float]) -> tuple[str | None, str]:
    """Returns (failure or None, a one-line report)."""
    assert len(ours) == len(theirs), f"{name}: we produced {len(ours)} tokens, transformers {len(theirs)}"
    for pos, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            continue
        where = f"{name}: first difference at new token {pos}: ours {a}, transformers {b}; HF top-2 margin {margins[pos]:.3g}"
        if margins[pos] < TIE_MARGIN:
            return None, where + " (near-tie: allowed, comparison stops here)"
        return where, where + " -> NOT a near-tie"
    return None, f"{name}: all {len(ours)} tokens identical"


def run_comparison(engine, hf_model, prompts: dict[str, list[int]], n: int) -> None:
    names = list(prompts)
    # All prompts at once: continuous batching with chunked prefill, as in serving.
    ours = engine.generate([prompts[k] for k in names], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    failures, lines = [], []
    for name, our_tokens in zip(names, ours):
        hf_tokens, margins = hf_greedy(hf_model, prompts[name], n)
        failure, line = compare(name, our_tokens, hf_tokens, margins)
        lines.append(line)
        if failure:
            failures.append(failure)
    print("\n".join(lines))
    assert not failures, "\n".join(failures)


# --- the tiny random model (fast; catches loader and attention bugs without the real weights) ---------------------


def test_tiny_model_greedy_matches_transformers(tiny_gguf, _tiny_engine_session):
    hf_model = load_hf_model(tiny_gguf)
    rng = random.Random(11)
    prompts = {f"random-{i}": [rng.randrange(100, 49000) for _ in range(rng.randint(2, 120))] for i in range(6)}
    run_comparison(_tiny_engine_session, hf_model, prompts, 24)


# --- the real SmolLM2-135M-Instruct ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_real_model(smollm2_path):
    return load_hf_model(smollm2_path)


@pytest.mark.real_model
@pytest.mark.slow
def test_real_model_greedy_matches_transformers(real_engine, tokenizer, hf_real_model):
    prompts = {
        q: tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS_ZH + QUESTIONS_EN
    }
    assert sum(len(p) for p in prompts.values()) > real_engine.args.max_num_batched_tokens, (
        "the prompts should need several steps to prefill, so that prefill chunks mix with decodes"
    )
    run_comparison(real_engine, hf_real_model, prompts, NEW_TOKENS)


@pytest.mark.real_model
def test_real_model_knows_the_capital_of_france(real_engine, tokenizer):
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = real_engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0))[0]
    text = tokenizer.decode(out)
    assert "Paris" in text, text
