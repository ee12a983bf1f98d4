"""Redaction scored on a corpus of Chinese and English texts: every miss and every false positive counts.

Each line of ``data/redaction_corpus.jsonl`` is ``{"text", "expect": [[entity type, exact substring], ...],
"note"}``; an empty ``expect`` is a trap (order numbers, timestamps, versions, prices, Luhn-invalid numbers...)
where nothing may be found. A span must match exactly, type included: a card taken for a phone is one miss and
one false positive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailguard.observe.redaction import Redactor, card_number_ok, cn_id_ok, cn_old_id_ok

CORPUS = Path(__file__).parents[1] / "data" / "redaction_corpus.jsonl"


def load_corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def expected_spans(case: dict) -> set[tuple[str, int, int]]:
    """(type, start, end) of each expected substring, repeated substrings taken in order of appearance."""
    spans, after = set(), {}
    for kind, sub in case["expect"]:
        start = case["text"].index(sub, after.get(sub, 0))
        after[sub] = start + len(sub)
        spans.add((kind, start, start + len(sub)))
    return spans


def score(find, cases: list[dict]) -> tuple[list[str], list[str]]:
    """Misses and false positives over the corpus, each as a readable line."""
    misses, false_pos = [], []
    for case in cases:
        text = case["text"]
        got = {(r.entity_type, r.start, r.end) for r in find(text)}
        want = expected_spans(case)
        misses += [f"{k} {text[s:e]!r} in {text!r}" for k, s, e in sorted(want - got)]
        false_pos += [f"{k} {text[s:e]!r} in {text!r}" for k, s, e in sorted(got - want)]
    return misses, false_pos


def test_corpus_is_big_and_mixed():
    cases = load_corpus()
    assert len(cases) >= 100
    assert sum(1 for c in cases if not c["expect"]) >= 40  # traps, not only positives
    assert sum(1 for c in cases if any("\u4e00" <= ch <= "\u9fff" for ch in c["text"])) >= 50
    kinds = {k for c in cases for k, _ in c["expect"]}
    assert kinds == {"CREDIT_CARD", "CN_RESIDENT_ID", "EMAIL_ADDRESS", "PHONE_NUMBER", "IP_ADDRESS"}


def test_corpus_labels_are_consistent():
    """The corpus itself: expected cards pass Luhn and an issuer's length, expected IDs their own checks."""
    for case in load_corpus():
        for kind, sub in case["expect"]:
            if kind == "CREDIT_CARD":
                assert card_number_ok(sub), sub
            elif kind == "CN_RESIDENT_ID":
                assert cn_id_ok(sub) or cn_old_id_ok(sub), sub


def test_corpus_has_no_misses_and_no_false_positives():
    pytest.importorskip("presidio_analyzer")
    misses, false_pos = score(Redactor().find, load_corpus())
    report = "\n".join(["misses:", *misses, "false positives:", *false_pos])
    assert (len(misses), len(false_pos)) == (0, 0), report
