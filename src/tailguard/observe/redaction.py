"""Redaction of personal data before any text is stored (``--store-text``): Presidio plus checked finders.

Everything here works offline, with no NLP model. Presidio's pattern recognizers find phone numbers (Google's
libphonenumber, Chinese mobiles included) and IP addresses, and its anonymizer replaces the spans. The kinds
hostile input writes in many shapes are found by this module, with the standard library's ``re``:

- Payment cards, 13 to 19 digits, plain, glued to Chinese text or in groups ("6212 3456 7890 1234 567",
  "4111-1111-..."): the issuer prefix must allow that length and the Luhn check must pass, so order numbers,
  timestamps, barcodes and prices stay.
- Chinese resident IDs: 18 characters with the ISO 7064 MOD 11-2 check character, with or without spaces or
  dashes ("110101 19900307 123X"), and the old 15-digit form (area + YYMMDD + 3 digits), which has no
  checksum: its province, city code and birth date must be real.
- E-mail addresses, internationalized ones included (``用户@例子.中国``, ``josé@bücher.de``, punycode): the
  domain must end in a public suffix, from tldextract's bundled list (never a download). A suffix glued to
  Chinese text ("a@b.com谢谢") is cut back to the longest one that is real.

Han characters count as word characters for Python, so ``\\b`` never fires between "卡号" and "4111..."; the
finders bound numbers by "no ASCII letter or digit next to it" instead, and full-width digits count as digits.

Presidio (which pulls in spaCy) is an optional extra, ``pip install 'tailguard[redaction]'``, needed only for
``--store-text``: it is imported when a :class:`Redactor` is built, never by importing this module.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterator
from functools import cached_property, lru_cache

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"
# The first two digits of a resident ID: provinces, Hong Kong/Macau/Taiwan residence permits (81-83).
_CN_PROVINCES = frozenset((*range(11, 16), *range(21, 24), *range(31, 38), *range(41, 47), *range(50, 55),
                           *range(61, 66), 71, 81, 82, 83))

DEFAULT_PHONE_REGIONS = ("CN", "HK", "TW", "SG", "US", "GB", "DE", "FR", "JP", "KR", "IN")
_REQUIRED = ("presidio_analyzer", "presidio_anonymizer", "tldextract", "regex")

# Digits as typed on Chinese keyboards too (full-width), and the separators people put between digit groups.
_D = "[0-9\uff10-\uff19]"
_SEP = "[ \\-\u00a0\u2009\u2013\u3000\uff0d]"
_SEP_CHARS = " -\u00a0\u2009\u2013\u3000\uff0d"
_ALNUM = "[0-9A-Za-z_\uff10-\uff19\uff21-\uff3a\uff41-\uff5a]"
_NORMALIZE = str.maketrans("０１２３４５６７８９Ｘｘ", "0123456789Xx", _SEP_CHARS)

# A run of digit groups joined by one kind of separator, not part of a word, a decimal or a dotted version.
_DIGIT_RUN = re.compile(
    rf"(?<!{_ALNUM})(?<!{_D}[.,]){_D}+(?:({_SEP}){_D}+(?:\1{_D}+)*)?(?!{_ALNUM})(?![.,]{_D})")
_X = "[0-9Xx\uff10-\uff19\uff38\uff58]"
_CN_ID18 = re.compile(
    rf"(?<!{_ALNUM})(?:{_D}{{6}}{_SEP}?{_D}{{4}}{_SEP}?{_D}{{4}}{_SEP}?{_D}{{3}}"  # 6-8-4, 6-4-4-4, plain
    rf"|{_D}{{4}}{_SEP}{_D}{{4}}{_SEP}{_D}{{4}}{_SEP}{_D}{{4}}{_SEP}{_D}"  # 4-4-4-4-2
    rf"|{_D}{{3}}{_SEP}{_D}{{3}}{_SEP}{_D}{{4}}{_SEP}{_D}{{4}}{_SEP}{_D}{{3}}){_X}(?!{_ALNUM})")
_DIGITS = re.compile(f"{_D}+")
_CN_ID15 = re.compile(rf"(?<!{_ALNUM}){_D}{{6}}{_SEP}?{_D}{{6}}{_SEP}?{_D}{{3}}(?!{_ALNUM})")

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002fa1f"
_IS_CJK = re.compile(f"[{_CJK}]")
_LOCAL_PUNCT = "._%+-"


class RedactionUnavailable(RuntimeError):
    """Text storage was asked for, but the redaction extra is not installed."""


def check_available() -> None:
    """Raise :class:`RedactionUnavailable` (with the install command) unless Presidio and its helpers import.

    Call it where ``--store-text`` is parsed, to fail before a model is loaded rather than at server start-up.
    """
    import importlib.util

    missing = [name for name in _REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise RedactionUnavailable(
            f"--store-text redacts personal data with Presidio, which is not installed (missing: "
            f"{', '.join(missing)}); install it with: pip install 'tailguard[redaction]' - or run without "
            f"--store-text (no text is stored then)")


def _plain(number: str) -> str:
    """Separators dropped, full-width digits folded to ASCII."""
    return number.translate(_NORMALIZE)


def _real_date(year: int, month: int, day: int) -> bool:
    try:
        return datetime.date(year, month, day) <= datetime.date.today()
    except ValueError:
        return False


def cn_id_checksum_ok(number: str) -> bool:
    """True when an 18-character Chinese resident ID (separators allowed) has a real birth date and a valid
    MOD 11-2 check character."""
    s = _plain(number).upper()
    if len(s) != 18 or not s[:17].isdigit() or not (s[17].isdigit() or s[17] == "X"):
        return False
    if not _real_date(int(s[6:10]), int(s[10:12]), int(s[12:14])) or int(s[6:10]) < 1900:
        return False
    total = sum(int(c) * w for c, w in zip(s[:17], _ID_WEIGHTS))
    return _ID_CHECK[total % 11] == s[17]


def cn_id_ok(number: str) -> bool:
    """An 18-character resident ID: a province or residence-permit code, a real date and the checksum."""
    s = _plain(number)
    return len(s) == 18 and s[:2].isdigit() and int(s[:2]) in _CN_PROVINCES and cn_id_checksum_ok(s)


def cn_old_id_ok(number: str) -> bool:
    """A 15-digit resident ID (issued before 1999): a mainland province, a city code (01-70, or 90 for
    counties under the province) and a real birth date in the 1900s.

    It has no check digit, so these are all that tell it from any other 15-digit number.
    """
    s = _plain(number)
    if len(s) != 15 or not s.isdigit() or int(s[:2]) not in _CN_PROVINCES or int(s[:2]) > 70:
        return False
    city_ok = 1 <= int(s[2:4]) <= 70 or s[2:4] == "90"
    return city_ok and _real_date(1900 + int(s[6:8]), int(s[8:10]), int(s[10:12]))


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, c in enumerate(reversed(digits)):
        d = int(c) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _card_lengths(d: str) -> tuple[int, ...]:
    """The lengths the issuer whose prefix ``d`` starts with gives its cards; () for no card issuer.

    Leading 1, 7, 8 (but UnionPay's 81), 9 and the year-like 20xx prefixes are no card's: that keeps
    millisecond timestamps, dates and most order numbers out.
    """
    two, three, four = int(d[:2]), int(d[:3]), int(d[:4])
    if four in (5018, 5020, 5038, 5893, 6304, 6759, 6761, 6762, 6763):  # Maestro
        return tuple(range(13, 20))
    if d[0] == "4":  # Visa
        return (13, 16, 19)
    if two in (34, 37):  # American Express
        return (15,)
    if 51 <= two <= 55 or 2221 <= four <= 2720:  # Mastercard
        return (16,)
    if two in (30, 36, 38, 39):  # Diners Club
        return tuple(range(14, 20))
    if (two in (60, 62, 65, 81) or 644 <= three <= 649 or 3528 <= four <= 3589
            or 2200 <= four <= 2204):  # RuPay, UnionPay, Discover, JCB, Mir
        return tuple(range(16, 20))
    return ()


def card_number_ok(number: str) -> bool:
    """A payment card number (separators allowed): an issuer's prefix and length, and the Luhn check.

    An 18-digit number that is a valid resident ID is taken for the ID (IDs from Jiangxi, Gansu, Ningxia and
    Xinjiang start like Diners, UnionPay and Discover cards).
    """
    s = _plain(number)
    if not (13 <= len(s) <= 19 and s.isdigit() and len(s) in _card_lengths(s)) or not luhn_ok(s):
        return False
    return not (len(s) == 18 and cn_id_ok(s))


def find_cards(text: str) -> Iterator[tuple[int, int]]:
    """Spans of card numbers: a whole digit run, or the leftmost longest run of its groups that is a card
    (a card followed by a CVV or preceded by an unrelated number is still found)."""
    for m in _DIGIT_RUN.finditer(text):
        if m.end() - m.start() < 13:
            continue
        if m.group(1) is None:  # one plain run: all of it or nothing, a digit run is never cut
            if card_number_ok(m.group()):
                yield m.span()
            continue
        groups = [g.span() for g in _DIGITS.finditer(m.group())]
        i = 0
        while i < len(groups):
            best = None
            size = 0
            for j in range(i, len(groups)):
                width = groups[j][1] - groups[j][0]
                size += width
                if size > 19:
                    break
                if j > i + 1 and not 3 <= groups[j - 1][1] - groups[j - 1][0] <= 6:
                    break  # inner groups of a card are 3 to 6 digits
                first = groups[i][1] - groups[i][0]
                layout_ok = 13 <= width <= 19 if j == i else 4 <= first <= 6
                if layout_ok and card_number_ok(m.group()[groups[i][0]:groups[j][1]]):
                    best = j
            if best is None:
                i += 1
                continue
            yield m.start() + groups[i][0], m.start() + groups[best][1]
            i = best + 1


def find_cn_ids(text: str) -> Iterator[tuple[int, int, bool]]:
    """Spans of resident IDs, with True for the 18-character (checksummed) form."""
    for m in _CN_ID18.finditer(text):
        if cn_id_ok(m.group()):
            yield m.start(), m.end(), True
    for m in _CN_ID15.finditer(text):
        if cn_old_id_ok(m.group()):
            yield m.start(), m.end(), False


def _local_char(c: str) -> bool:
    return c in _LOCAL_PUNCT or ((c.isalnum() or "\u0300" <= c <= "\u036f") and not _IS_CJK.match(c))


def _domain_char(c: str) -> bool:
    return c.isalnum() or c in ".-" or "\u0300" <= c <= "\u036f"


def find_emails(text: str, is_domain: Callable[[str], bool]) -> Iterator[tuple[int, int]]:
    """Spans of e-mail addresses, found from each ``@`` outwards (linear, whatever the text).

    The local part is a run of Latin (or other non-CJK) letters, digits and ``._%+-``, or a run of CJK
    characters: a CJK local part glued to Chinese text takes the whole run, since nothing marks where the
    address starts. ``is_domain`` says whether a host name ends in a public suffix.
    """
    for at in (i for i, c in enumerate(text) if c in "@\uff20"):
        start, floor = at, max(0, at - 64)  # RFC 5321: 64 characters of local part, 253 of domain at most
        if at and _IS_CJK.match(text[at - 1]):
            while start > floor and _IS_CJK.match(text[start - 1]):
                start -= 1
        else:
            while start > floor and _local_char(text[start - 1]):
                start -= 1
            while start < at and text[start] == ".":
                start += 1
        local = text[start:at]
        if not local or local.endswith(".") or ".." in local:
            continue
        end = at + 1
        while end < min(len(text), at + 254) and _domain_char(text[end]):
            end += 1
        host = _host(text[at + 1:end], is_domain)
        if host:
            yield start, at + 1 + len(host)


def _host(candidate: str, is_domain: Callable[[str], bool]) -> str:
    """The longest leading part of ``candidate`` that is a host name under a public suffix, or ''."""
    labels = candidate.rstrip(".-").split(".")
    while len(labels) >= 2:
        if all(lb and lb[0] != "-" and lb[-1] != "-" for lb in labels):
            if is_domain(".".join(labels)):
                return ".".join(labels)
            last = labels[-1]
            # A non-ASCII suffix may run into the Chinese that follows it: "中国谢谢", "com谢谢".
            for cut in range(len(last) - 1, 0, -1) if not last.isascii() else ():
                host = ".".join([*labels[:-1], last[:cut]])
                if is_domain(host):
                    return host
        labels.pop()
    return ""


def _not_a_phone(text: str, start: int, end: int) -> bool:
    """libphonenumber's matches that are something else.

    A number right after "HT-", "A1/" and the like is a segment of a contract or order code. A bare run of 13
    or more digits is a timestamp, an order number or an ID unless it starts with a country prefix as typed
    in China (00, 86): libphonenumber reads millisecond timestamps as German pager numbers.
    """
    if start >= 2 and text[start - 1] in "-_/" and text[start - 2].isascii() and text[start - 2].isalnum():
        return True
    digits = _plain(text[start:end])
    return len(digits) >= 13 and text[start:end].isdigit() and not digits.startswith(("00", "86"))


# Which of two results for the same text wins: the checksummed kinds before the looser ones.
_RANK = {"CN_RESIDENT_ID": 4, "CREDIT_CARD": 3, "EMAIL_ADDRESS": 3, "CN_RESIDENT_ID_15": 2, "IP_ADDRESS": 1,
         "PHONE_NUMBER": 0}


def _resolve(found: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Non-overlapping spans in text order: a span inside another is dropped (for the same text, the higher
    ranked kind stays), and two that cross become one, of the longer one's kind: nothing is half-redacted."""
    kept: list[list] = []
    for kind, start, end in sorted(found, key=lambda f: (f[1], f[1] - f[2], -_RANK[f[0]])):
        if kept and start < kept[-1][2]:
            prev = kept[-1]
            if end > prev[2]:
                if end - start > prev[2] - prev[1]:
                    prev[0] = kind
                prev[2] = end
            continue
        kept.append([kind, start, end])
    return [(kind, start, end) for kind, start, end in kept]


class Redactor:
    """Find and replace personal data: ``redact("邮箱 a@b.com")`` -> ``"邮箱 <EMAIL_ADDRESS>"``.

    Construction imports Presidio (a few seconds: it pulls in spaCy); do it once at start-up, off the event loop.
    Thread-safe for concurrent ``redact`` calls: recognizers hold no per-call state.
    """

    def __init__(self, phone_regions: tuple[str, ...] = DEFAULT_PHONE_REGIONS) -> None:
        self.phone_regions = phone_regions
        check_available()
        try:
            _ = self._recognizers  # import and build now, not on the first request
            _ = self._anonymizer
            _ = self._is_domain
        except ImportError as exc:  # a partial or broken install
            raise RedactionUnavailable(
                f"--store-text needs Presidio, which failed to import ({exc}); reinstall it with: "
                f"pip install 'tailguard[redaction]'") from exc

    @cached_property
    def _recognizers(self) -> list:
        import regex
        from presidio_analyzer.predefined_recognizers import IpRecognizer, PhoneRecognizer

        # Presidio matches with the third-party ``regex`` module, whose flag values differ from ``re``'s;
        # ASCII, so that ``\b`` fires between Han characters and an address.
        self._flags = regex.DOTALL | regex.MULTILINE | regex.IGNORECASE | regex.ASCII
        return [PhoneRecognizer(supported_regions=self.phone_regions), IpRecognizer()]

    @cached_property
    def _is_domain(self) -> Callable[[str], bool]:
        import tldextract

        offline_tlds = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

        @lru_cache(maxsize=4096)
        def is_domain(host: str) -> bool:
            parts = offline_tlds(host)
            return bool(parts.suffix and parts.domain)

        return is_domain

    @cached_property
    def _anonymizer(self):
        from presidio_anonymizer import AnonymizerEngine

        return AnonymizerEngine()

    def find(self, text: str) -> list:
        """Presidio RecognizerResults for every personal-data span in ``text``, overlaps resolved: a span
        inside another is dropped, and two that cross become one (nothing is left half-redacted)."""
        from presidio_analyzer import RecognizerResult

        found: list[tuple[str, int, int]] = []
        for rec in self._recognizers:
            if hasattr(rec, "patterns"):
                results = rec.analyze(text, rec.supported_entities, None, regex_flags=self._flags)
            else:
                results = rec.analyze(text, rec.supported_entities, None)
            found.extend((r.entity_type, r.start, r.end) for r in results or [] if r.score > 0
                         and not (r.entity_type == "PHONE_NUMBER" and _not_a_phone(text, r.start, r.end)))
        found.extend(("CREDIT_CARD", s, e) for s, e in find_cards(text))
        found.extend(("CN_RESIDENT_ID" if full else "CN_RESIDENT_ID_15", s, e)
                     for s, e, full in find_cn_ids(text))
        if "@" in text or "\uff20" in text:
            found.extend(("EMAIL_ADDRESS", s, e) for s, e in find_emails(text, self._is_domain))

        return [RecognizerResult(kind.removesuffix("_15"), start, end, 0.5 + _RANK[kind] / 10)
                for kind, start, end in _resolve(found)]

    def redact(self, text: str | None) -> str | None:
        if not text:
            return text
        results = self.find(text)
        if not results:
            return text
        return self._anonymizer.anonymize(text=text, analyzer_results=results).text
