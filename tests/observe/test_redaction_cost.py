"""Redaction's cost is bounded and its finds are unchanged.

Phones used to be found by running libphonenumber's matcher over the whole text for 11 regions (~12 ms per KB,
~20 s for 100 KB of digit groups), IPs by Presidio's patterns over the whole text. Now the matcher runs only on
windows around the digit runs the regions' metadata allow, and a CPU-time budget per call bounds the rest: what
is left unchecked is masked. These tests hold the new finders to the old results on generated text, and the
cost to its bound on hostile text.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from tailguard.observe import redaction
from tailguard.observe.redaction import DEFAULT_PHONE_REGIONS, Redactor, find_cards, luhn_ok

pytest.importorskip("presidio_analyzer")


@pytest.fixture(scope="module")
def redactor():
    return Redactor()


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _phone_texts(seed: int, n: int) -> list[str]:
    """Chinese and English around numbers of every shape the matcher looks at: real numbers of each region in
    national and international formats (some digits changed), digit groups with its separators, brackets,
    plus signs, extensions, dates and times, full-width and Arabic-Indic digits."""
    import phonenumbers
    from phonenumbers import PhoneNumberFormat, PhoneNumberType

    rng = random.Random(seed)
    examples = []
    for region in DEFAULT_PHONE_REGIONS:
        for kind in (PhoneNumberType.FIXED_LINE, PhoneNumberType.MOBILE, PhoneNumberType.TOLL_FREE):
            number = phonenumbers.example_number_for_type(region, kind)
            if number is not None:
                examples += [phonenumbers.format_number(number, f) for f in
                             (PhoneNumberFormat.NATIONAL, PhoneNumberFormat.INTERNATIONAL, PhoneNumberFormat.E164)]
    seps = [" ", "-", ".", "/", " - ", "\u00a0", "\u3000", "\uff0d", "\u2013", ")", "(", " (", "x", " x ", "~"]

    def number() -> str:
        k = rng.random()
        if k < 0.3:  # a real number, its last digits changed now and then, more digits after it at times
            s = rng.choice(examples)
            s = s if rng.random() < 0.5 else s[:-3] + _digits(rng, 3)
            if rng.random() < 0.2:
                s += rng.choice(["(", "/", " ", ".", "-", "~", "x"]) + _digits(rng, rng.randint(1, 8))
            return s
        if k < 0.55:
            out = _digits(rng, rng.randint(1, 5))
            for _ in range(rng.randint(1, 4)):
                out += rng.choice(seps) + _digits(rng, rng.randint(1, 5))
            return rng.choice(["", "", "+", "(", "+(", "\uff0b", "00", "0"]) + out
        if k < 0.7:
            return rng.choice(["1", "+86 1", "+0", "010-", "(0", "+1 (", "86"]) + _digits(rng, rng.randint(2, 11))
        if k < 0.8:
            return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} " \
                   f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
        if k < 0.9:
            return _digits(rng, rng.randint(4, 11)) + rng.choice([" ext. ", " x", " #", ";ext=", " доб "]) + \
                _digits(rng, rng.randint(1, 4))
        return _digits(rng, rng.randint(1, 20))

    words = ["电话", "手机：", "call ", "Tel:", "，", "。", " ", "abc", "$", "%", "x", "号码", "(", "\n", "page "]
    texts = []
    for _ in range(n):
        parts = [rng.choice(words) + number() for _ in range(rng.randint(1, 5))]
        text = "".join(parts) + rng.choice(words)
        k = rng.random()
        if k < 0.05:
            text = text.translate(str.maketrans("0123456789", "０１２３４５６７８９"))
        elif k < 0.08:
            text = text.translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
        texts.append(text)
    return texts


def _whole_text_phones(text: str) -> set[tuple[int, int]]:
    """What the redactor found before: Presidio's PhoneRecognizer, libphonenumber's matcher on the whole text
    for every region, less the spans that are something else."""
    from presidio_analyzer.predefined_recognizers import PhoneRecognizer

    recognizer = PhoneRecognizer(supported_regions=DEFAULT_PHONE_REGIONS)
    return {(r.start, r.end) for r in recognizer.analyze(text, ["PHONE_NUMBER"], None)
            if r.score > 0 and not redaction._not_a_phone(text, r.start, r.end)}


def _phones(redactor, text: str) -> set[tuple[int, int]]:
    found: list = []
    redactor._phones.find(text, redaction._Budget(60.0), found)
    return {(s, e) for kind, s, e in found if kind == "PHONE_NUMBER"}


@pytest.mark.parametrize("text", [
    "+44 20 8751 1761(0.58.964.811/10)",  # after a plus number, a number for one region only
    " 7019~6672~7\u30002803 (68page",  # "~7" read as an extension
    "(+03964\u00a083561x4@",  # no country code after the plus: read as a national number
    "v-594-274-3145#046 6954 9743",  # the extension takes digits the next run starts with
    "价格¥17593757133x18370996596#19601660981(",
    "身份证11010519491231002X，旧证 110101900307123",  # a check character X is no extension
    "2019-01-02 04:44:41 启动, 11/26/88",  # dates the matcher skips
    "电话 010-62345678，传真 +86 21 6234 5678，手机 138 1234 5678 ext. 12",
    "http://192.168.1.1/x(010-81967556/6212345678901234569",  # "/x" ends a candidate, the next starts there
])
def test_phones_in_shapes_that_once_went_wrong(redactor, text):
    assert _phones(redactor, text) == _whole_text_phones(text)


def test_phones_are_the_whole_text_matchers(redactor):
    """The windows, the metadata check and the regions left out change no find: the spans are those found
    before, on generated text."""
    found_any = 0
    for text in _phone_texts(seed=7, n=400):
        before = _whole_text_phones(text)
        assert _phones(redactor, text) == before, text
        found_any += bool(before)
    assert found_any > 100  # the texts do hold phones


def test_ips_are_presidios(redactor):
    from presidio_analyzer.predefined_recognizers import IpRecognizer

    rng = random.Random(3)
    hexes = "0123456789abcdefABCDEF"

    def token() -> str:
        k = rng.random()
        if k < 0.35:
            return ".".join(str(rng.choice([rng.randint(0, 255), rng.randint(0, 999)])) for _ in
                            range(rng.choice([3, 4, 4, 5]))) + rng.choice(["", "", f"/{rng.randint(0, 40)}"])
        if k < 0.6:
            return ":".join("".join(rng.choice(hexes) for _ in range(rng.randint(0, 4)))
                            for _ in range(rng.randint(2, 9)))
        if k < 0.8:
            return rng.choice(["::1", "::", "fe80::1%eth0", "::ffff:10.0.0.1", "64:ff9b::192.0.2.33", "std::vector",
                               "[::1]:80", "10.0.0.1:8080", "http://192.168.1.1/x", "v1.2.3", "3.14159"])
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}"

    recognizer = IpRecognizer()
    flags = redactor._ips._patterns[0][0].flags
    found_any = 0
    for _ in range(400):
        text = "".join(rng.choice(["IP地址", " ", "，", "server ", "(", "a", ":", "."]) + token()
                       for _ in range(rng.randint(1, 4)))
        before = {(r.start, r.end) for r in recognizer.analyze(text, ["IP_ADDRESS"], None, regex_flags=flags)}
        found: list = []
        redactor._ips.find(text, redaction._Budget(60.0), found)
        # Presidio drops an address inside another; the redactor's overlap resolution does the same later.
        assert set(redaction._drop_contained([(s, e) for _, s, e in found])) == before, text
        found_any += bool(before)
    assert found_any > 100


def test_spans_inside_others_are_dropped_as_presidio_does():
    from presidio_analyzer import EntityRecognizer, RecognizerResult

    rng = random.Random(5)
    for _ in range(300):
        spans = [(s, s + rng.randint(1, 12)) for s in (rng.randint(0, 40) for _ in range(rng.randint(1, 12)))]
        expected = EntityRecognizer.remove_duplicates([RecognizerResult("PHONE_NUMBER", s, e, 0.4) for s, e in spans])
        assert sorted(redaction._drop_contained(spans)) == sorted((r.start, r.end) for r in expected)


def test_the_libraries_internals_it_leans_on_are_there(redactor):
    """The matcher's own ways to cut a candidate and to skip dates (private to phonenumbers), and its characters
    between and before digit groups: without the first, no region would be ruled out (slow, still right)."""
    from phonenumbers import phonenumbermatcher, phonenumberutil

    phones = redactor._phones
    assert phones._inner is not None and phones._dates is not None
    assert phones._times is not None and phones._minutes is not None
    assert redaction._SECOND_NUMBER.pattern == phonenumberutil._SECOND_NUMBER_START_PATTERN.pattern
    punct = re.compile(f"[{redaction._PHONE_PUNCT}]", re.IGNORECASE)
    theirs = phonenumberutil._VALID_PUNCTUATION.replace("\\", "")
    assert all(punct.match(c) for c in theirs)
    assert set(redaction._PHONE_LEAD.replace("\\", "")) == set(phonenumbermatcher._LEAD_CLASS_CHARS.replace("\\", ""))


def test_no_public_suffix_label_is_longer_than_the_cut_back_allows():
    tldextract = pytest.importorskip("tldextract")
    suffixes = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None).tlds
    assert max(len(s.rsplit(".", 1)[-1]) for s in suffixes) <= redaction._MAX_SUFFIX_LABEL


def test_a_host_costs_a_bounded_number_of_suffix_lookups():
    calls: list[str] = []

    def is_domain(host: str) -> bool:
        calls.append(host)
        return False

    assert redaction._host("b." + "\u00e9" * 250, is_domain) == ""  # a non-ASCII label cut back char by char
    assert len(calls) <= redaction._MAX_HOST_LOOKUPS + redaction._MAX_SUFFIX_LABEL
    calls.clear()
    assert redaction._host(".".join(["a"] * 120), is_domain) == ""  # 120 labels popped one by one
    assert len(calls) <= redaction._MAX_HOST_LOOKUPS + redaction._MAX_SUFFIX_LABEL


def test_luhn():
    def reference(digits: str) -> bool:
        total = 0
        for i, c in enumerate(reversed(digits)):
            d = int(c) * (2 if i % 2 else 1)
            total += d - 9 if d > 9 else d
        return total % 10 == 0

    rng = random.Random(1)
    for _ in range(2000):
        digits = _digits(rng, rng.randint(1, 19))
        assert luhn_ok(digits) == reference(digits), digits
    assert luhn_ok("\uff14" + "\uff11" * 15)  # full-width 4111...


def _cpu(fn):
    t0 = time.thread_time()
    out = fn()
    return out, time.thread_time() - t0


def _groups(n_bytes: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.randint(0, 9999):04d}" for _ in range(n_bytes // 5))


def test_a_long_run_of_digit_groups_is_cheap_for_the_card_finder():
    # Each candidate was cut from a copy of the whole run: quadratic (1.6 s for 100 KB), now linear (~50 ms).
    text = "卡号 " + _groups(100_000)
    _, cpu = _cpu(lambda: list(find_cards(text)))
    assert cpu < 0.6


def test_hostile_digit_groups_stay_within_the_budget_and_leak_nothing(redactor):
    """100 KB of 4-digit groups took ~20 s in libphonenumber; the budget (~160 ms here) holds it, and a phone
    in the middle is masked, checked or not."""
    text = _groups(50_000) + " 手机 13812345678 " + _groups(50_000, seed=2)
    out, cpu = _cpu(lambda: redactor.redact(text))
    assert cpu < 1.5
    assert "13812345678" not in out
    # With a budget far too small for it: up to where it ran out the groups were checked (a few are cards or
    # phones), after it none is left.
    out = Redactor(budget_ms=20, budget_ms_per_kchar=0).redact(text)
    assert "13812345678" not in out
    assert not re.search(r"\d{4} \d{4}", out.split("<UNCHECKED_NUMBER>", 1)[1])


def test_prose_is_cheap(redactor):
    rng = random.Random(2)
    words = "the queue was long so we kept only what the operator asked for and dropped the rest".split()

    def number() -> str:
        return rng.choice([str(rng.randint(1, 9999)), str(rng.randint(1990, 2030)),
                           f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}", f"{rng.randint(0, 23):02d}:30",
                           f"{rng.randint(2019, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"])

    text = " ".join(rng.choice(words) if rng.random() > 0.05 else number() for _ in range(40_000))  # ~200 KB
    redactor.find(text[:1000])
    _, cpu = _cpu(lambda: redactor.find(text))
    assert cpu < 0.5  # ~0.06 s; the whole-text matcher took ~1 s


def test_past_the_budget_what_is_unchecked_is_masked():
    """No budget at all: every run of 7+ digits, every IP-shaped token and every local@dotted.host is masked
    without a check; cards and resident IDs are still checked, and short numbers stay."""
    unchecked = Redactor(budget_ms=0, budget_ms_per_kchar=0)
    text = ("call 138 1234 5678 or 010-62345678, order 12345, server 10.0.0.1, mail a@b.notatld, "
            "card 4111 1111 1111 1111, 身份证11010519491231002X")
    assert unchecked.redact(text) == (
        "call <UNCHECKED_NUMBER> or <UNCHECKED_NUMBER>, order 12345, server <IP_ADDRESS>, mail <EMAIL_ADDRESS>, "
        "card <CREDIT_CARD>, 身份证<CN_RESIDENT_ID>")
    checked = Redactor(budget_ms=60_000)
    assert checked.redact(text) == (
        "call <PHONE_NUMBER> or <PHONE_NUMBER>, order 12345, server <IP_ADDRESS>, mail a@b.notatld, "
        "card <CREDIT_CARD>, 身份证<CN_RESIDENT_ID>")
