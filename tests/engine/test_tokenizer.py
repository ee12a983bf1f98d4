"""The GGUF tokenizer (byte-level BPE built from the GGUF vocabulary), its chat template and the detokenizer."""

from __future__ import annotations

import pytest

from tailguard.engine.tokenizer import IncrementalDetokenizer

ROUND_TRIP_TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界！今天天气怎么样？我想去公园散步。",
    "Emoji: 🤖🎉👍🏽 and a family 👨‍👩‍👧‍👦.",
    "混合 mixed 文本 text, with punctuation — «quotes» and ‘apostrophes’.",
    "  leading spaces, trailing spaces  \n\nnew lines\tand tabs\r\n",
    "Ünïcödé àccents, Ελληνικά, русский, العربية, 日本語のテキスト, 한국어.",
    "Version 3.14 and 2024-06-01, 1,000,000 items",
]

# No multi-digit numbers here: older transformers GGUF converters drop SmolLM2's individual-digit split.
HF_COMPARE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "请用三句话介绍一下长城的历史。",
    "上海是中国最大的城市之一，也是重要的金融中心。",
    "Emoji test 🤖🎉 with spaces   and\nnewlines",
    "What's the capital of France? It's Paris, isn't it?",
    "Mixed 中文 and English 文本 in one sentence.",
    "Tabs\tand   multiple    spaces; URL https://example.com/a?b=c&d=e",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids, "text encoded to nothing"
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_stop_generation(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.eos_token_id == 2
    assert 2 in tokenizer.stop_token_ids
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_digits_are_split_one_by_one(tokenizer, hf_tokenizer):
    ids = tokenizer.encode("12345")
    assert [tokenizer.tokens[i] for i in ids] == ["1", "2", "3", "4", "5"]
    ids = tokenizer.encode("in 2024")
    assert [tokenizer.tokens[i] for i in ids][-4:] == ["2", "0", "2", "4"]
    # For the record (not asserted: it depends on the transformers version): what transformers' GGUF tokenizer does.
    hf_ids = hf_tokenizer.encode("12345", add_special_tokens=False)
    print("transformers' GGUF tokenizer on '12345':", hf_tokenizer.convert_ids_to_tokens(hf_ids))


def test_same_ids_as_transformers(tokenizer, hf_tokenizer):
    for text in HF_COMPARE_TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text


def test_chat_template_renders_chatml(tokenizer):
    rendered = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "你好！"},
        {"role": "user", "content": "Bye"},
    ]
    rendered = tokenizer.render_chat(conversation, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\n你好！<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    ids = tokenizer.encode_chat(conversation)
    assert ids.count(1) == 5 and ids.count(2) == 4, "one <|im_start|> per turn plus the generation prompt"
    last_turn = len(ids) - 1 - ids[::-1].index(1)
    assert tokenizer.decode(ids[last_turn:], skip_special_tokens=False) == "<|im_start|>assistant\n"


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    messages = [{"role": "user", "content": "请介绍一下你自己。"}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(messages) == expected
    assert tokenizer.encode_chat(messages) == hf_tokenizer.encode(expected, add_special_tokens=False)


def test_encode_batch_and_cache_agree_with_encode(tokenizer):
    texts = ROUND_TRIP_TEXTS[:4]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(t) for t in texts]
    first = tokenizer.encode(texts[1])
    first.append(12345)  # the caller owns the returned list; the cache must not change
    hits = tokenizer.cache_hits
    again = tokenizer.encode(texts[1])
    assert tokenizer.cache_hits == hits + 1
    assert again == tokenizer.encode_batch([texts[1]])[0]


@pytest.mark.parametrize(
    "text",
    [
        "北京是中国的首都，有着三千多年的建城史。长城、故宫和天坛都是著名的景点。",
        "混合 text 与表情 🤖🎉 和标点：「你好」！",
    ],
)
def test_incremental_detokenizer_reproduces_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 2, "expected multi-token characters in this text"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for i, token in enumerate(ids):
        delta = detok.add(token)
        deltas.append(delta)
        assert "\ufffd" not in delta, f"half a character leaked at token {i}"
        assert tokenizer.decode(ids[: i + 1]).startswith(detok.text)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
    assert any(d == "" for d in deltas), "some characters span several tokens and must be held back"


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("好的。") + [2] + tokenizer.encode(" Next")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert deltas[len(ids) - len(tokenizer.encode(" Next")) - 1] == ""
    assert detok.text == "好的。 Next" == tokenizer.decode(ids)


def test_encode_cache_is_bounded_by_bytes_and_evicts_lru(smollm2_path, tokenizer):
    from tailguard.engine.tokenizer import GGUFTokenizer

    budget = 1 << 20
    tok = GGUFTokenizer(smollm2_path, cache_bytes=budget)
    texts = [f"prompt {i}: " + "word " * 8000 for i in range(10)]  # ~40 kB of text, ~8k ids each
    for t in texts[:3]:
        tok.encode(t)
    tok.encode(texts[0])  # texts[0] is now the most recently used
    hits = tok.cache_hits
    for t in texts[3:]:
        tok.encode(t)
        assert tok.cache_bytes <= budget
    assert 1 <= len(tok._cache) < 10, "the byte budget, not the 4,096-entry cap, must bound the cache"
    assert tok.encode(texts[-1]) == tokenizer.encode(texts[-1]) and tok.cache_hits == hits + 1
    tok.encode(texts[1])  # least recently used: evicted long ago
    assert tok.cache_hits == hits + 1
    # An encoding larger than the whole budget is not cached (and evicts nothing).
    before = dict(tok._cache)
    huge = "word " * 60000
    assert tok.encode(huge) == tokenizer.encode(huge)
    assert huge not in tok._cache and tok._cache.keys() == before.keys()
    off = GGUFTokenizer(smollm2_path, cache_bytes=0)
    off.encode(texts[0])
    off.encode(texts[0])
    assert off.cache_hits == 0 and off.cache_bytes == 0


def test_incremental_detokenizer_continues_a_prompt_tail(tokenizer):
    tail = tokenizer.encode("用户说：")
    ids = tokenizer.encode(" 你好 🤖 world")
    detok = IncrementalDetokenizer(tokenizer, prompt_tail=tail)
    deltas = [detok.add(t) for t in ids]
    assert detok.text == "".join(deltas) == tokenizer.decode(tail + ids)[len(tokenizer.decode(tail)):]
    assert detok.num_tokens == len(ids)
