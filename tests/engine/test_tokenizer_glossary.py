"""The tokenizer's batch encode through the cache (``encode_many``) and the pinned domain glossary: both only spare
work, so every id must be what ``encode`` gives one text at a time on a tokenizer without them."""

from __future__ import annotations

import pytest

from tailguard.engine.tokenizer import GGUFTokenizer
from tests.engine.test_tokenizer import HF_COMPARE_TEXTS, ROUND_TRIP_TEXTS

GLOSSARY = ["心肌梗死", "急性冠脉综合征", "高血压", "糖尿病肾病", "myocardial infarction", "acute coronary syndrome",
            "hypertension", "diabetic nephropathy", "β-blocker", "HbA1c 7.5%", "SpO₂", "🩺 stethoscope"]
TEXTS = [
    *ROUND_TRIP_TEXTS, *HF_COMPARE_TEXTS, *GLOSSARY,
    "患者，男，65岁，因胸痛3小时入院，诊断为急性心肌梗死，既往有高血压病史10年。",
    "The patient, a 65-year-old man with hypertension, was admitted with chest pain; ECG showed myocardial infarction.",
    " hypertension", "hypertension ", "高血压。", "心肌梗死后", "", " ", "🩺", "<|im_end|>",
]


@pytest.fixture(scope="module")
def plain(smollm2_path):
    """The reference: no cache, no glossary, one text at a time."""
    return GGUFTokenizer(smollm2_path, cache_size=0)


def _chat(tok: GGUFTokenizer) -> list[str]:
    convs = [[{"role": "user", "content": "请解释一下心肌梗死的症状。"}],
             [{"role": "system", "content": "You are a careful clinician 🩺."},
              {"role": "user", "content": "What is diabetic nephropathy? Answer in 2 sentences."}],
             [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 👋"},
              {"role": "user", "content": "混合 mixed 文本"}]]
    return [tok.render_chat(c) for c in convs]


def test_encode_many_equals_encode_one_by_one(smollm2_path, plain):
    tok = GGUFTokenizer(smollm2_path)
    texts = TEXTS + _chat(plain)
    want = [plain.encode(t) for t in texts]
    assert want == [plain._tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert tok.encode_many(texts) == want  # all misses: one batch
    hits = tok.cache_hits
    assert tok.encode_many(texts) == want  # all hits now
    assert tok.cache_hits - hits == len(texts)
    # Half cached, half not, repeats within the batch: still the same ids, each its own list.
    fresh = [t + " (again)" for t in texts]
    mixed = [x for pair in zip(texts, fresh, fresh) for x in pair]
    got = tok.encode_many(mixed)
    assert got == [plain.encode(t) for t in mixed]
    got[1].append(-1)
    assert got[2] != got[1] and tok.encode(fresh[0]) == plain.encode(fresh[0])


def test_glossary_never_changes_the_ids(smollm2_path, plain):
    with_glossary = GGUFTokenizer(smollm2_path)
    stats = with_glossary.set_glossary(GLOSSARY + ["", GLOSSARY[0]])  # blanks and repeats are dropped
    assert stats.terms == len(GLOSSARY) and stats.dropped == 0
    assert stats.tokens == sum(len(plain.encode(t)) for t in GLOSSARY)
    texts = TEXTS + _chat(plain)
    for text in texts:
        assert with_glossary.encode(text) == plain.encode(text), text
    assert with_glossary.encode_many(texts) == [plain.encode(t) for t in texts]
    # Each exact term is served from the glossary.
    before = with_glossary.glossary_hits
    for term in GLOSSARY:
        assert with_glossary.lookup(term) == plain.encode(term)
    assert with_glossary.glossary_hits - before == len(GLOSSARY)
    stats = with_glossary.cache_stats()
    assert stats["glossary_terms"] == len(GLOSSARY) and stats["glossary_bytes"] > 0


def test_glossary_is_pinned_and_replaced_as_a_whole(smollm2_path, plain):
    tok = GGUFTokenizer(smollm2_path, cache_size=2)
    tok.encode("心肌梗死")  # in the LRU first: pinning moves it out (no entry twice)
    tok.set_glossary(["心肌梗死", "高血压"])
    assert "心肌梗死" not in tok._cache
    for i in range(20):  # traffic churns the 2-entry LRU
        tok.encode(f"unrelated prompt {i}")
    assert tok.lookup("心肌梗死") == plain.encode("心肌梗死")
    tok.set_glossary(["糖尿病", "hypertension"])
    assert tok.lookup("心肌梗死") is None and tok.lookup("hypertension") == plain.encode("hypertension")
    tok.set_glossary([])
    assert tok.lookup("hypertension") is None and tok.glossary_bytes == 0


def test_glossary_keeps_to_its_byte_budget(smollm2_path):
    tok = GGUFTokenizer(smollm2_path)
    terms = [f"term number {i}" for i in range(200)]
    stats = tok.set_glossary(terms, max_bytes=20_000)
    assert 0 < stats.terms < 200 and stats.terms + stats.dropped == 200
    assert stats.bytes <= 20_000 and tok.glossary_bytes == stats.bytes


def test_glossary_works_with_the_cache_off(smollm2_path, plain):
    tok = GGUFTokenizer(smollm2_path, cache_size=0)
    tok.set_glossary(["hypertension"])
    assert tok.encode("hypertension") == plain.encode("hypertension") and tok.glossary_hits == 1
    assert tok.encode("hypertension!") == plain.encode("hypertension!") and tok._cache == {}
