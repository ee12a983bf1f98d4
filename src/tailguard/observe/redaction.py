"""Redaction of personal data before any text is stored (``--store-text``): Presidio plus checked finders.

Everything here works offline, with no NLP model. Phone numbers are Google's libphonenumber's (Chinese mobiles
included), IP addresses Presidio's IpRecognizer's, and Presidio's anonymizer replaces the spans. The kinds
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
- Credentials (:func:`find_secrets`): provider keys and tokens by their issuers' prefixes (``API_KEY``), JWTs and
  the credentials of an Authorization header or after "Bearer" (``ACCESS_TOKEN``), the user:password of a URL and
  the value of a setting named like a secret, ``password: ...``, ``AWS_SECRET_ACCESS_KEY=...`` (``SECRET``).

Han characters count as word characters for Python, so ``\\b`` never fires between "卡号" and "4111..."; the
finders bound numbers by "no ASCII letter or digit next to it" instead, and full-width digits count as digits.

Cost. Redaction runs on the request store's writer thread, which every request's record waits for, so it must
stay cheap whatever the text: ~0.3 ms per 1,000 characters of prose, ~3 ms for 1 KB dense with phone numbers
(run over the whole text, libphonenumber took ~12 ms per KB, and 20 s for 100 KB of digit groups). libphonenumber
is asked only about the digit runs its metadata says could be a number, on a window around each (the matches
are those it finds in the whole text), and Presidio's IP patterns run only on tokens with a dotted digit or two
colons. What is left beyond a CPU-time budget per call is masked unchecked, never stored in clear
(:class:`Redactor`).

Presidio (which pulls in spaCy) is an optional extra, ``pip install 'tailguard[redaction]'``, needed only for
``--store-text``: it is imported when a :class:`Redactor` is built, never by importing this module.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Callable, Iterator
from functools import cached_property, lru_cache

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"
# The first two digits of a resident ID: provinces, Hong Kong/Macau/Taiwan residence permits (81-83).
_CN_PROVINCES = frozenset((*range(11, 16), *range(21, 24), *range(31, 38), *range(41, 47), *range(50, 55),
                           *range(61, 66), 71, 81, 82, 83))

DEFAULT_PHONE_REGIONS = ("CN", "HK", "TW", "SG", "US", "GB", "DE", "FR", "JP", "KR", "IN")
_REQUIRED = ("presidio_analyzer", "presidio_anonymizer", "phonenumbers", "tldextract", "regex")

# Digits as typed on Chinese keyboards too (full-width), and the separators people put between digit groups.
_D = "[0-9\uff10-\uff19]"
_SEP = "[ \\-\u00a0\u2009\u2013\u3000\uff0d]"
_SEP_CHARS = " -\u00a0\u2009\u2013\u3000\uff0d"
_ALNUM = "[0-9A-Za-z_\uff10-\uff19\uff21-\uff3a\uff41-\uff5a]"
_NORMALIZE = str.maketrans("０１２３４５６７８９Ｘｘ", "0123456789Xx", _SEP_CHARS)
_LUHN_DOUBLED = str.maketrans("0123456789", "0246813579")  # 2*d, its two digits added when over 9
_CARD_FIRST_DIGITS = frozenset("234568２３４５６８")  # what the issuers' prefixes start with (_card_lengths)

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
_AT = re.compile("[@\uff20]")


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
    if not digits.isascii():
        digits = "".join(str(int(c)) for c in digits)
    # Every second digit from the right doubled and its digits added (a table), all digits summed as bytes
    # (each ASCII digit is its value + 48): a few C loops instead of one Python step per digit.
    total = sum(digits[-1::-2].encode()) + sum(digits[-2::-2].translate(_LUHN_DOUBLED).encode())
    return (total - 48 * len(digits)) % 10 == 0


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
        run = m.group()
        if m.group(1) is None:  # one plain run: all of it or nothing, a digit run is never cut
            if card_number_ok(run):
                yield m.span()
            continue
        groups = [g.span() for g in _DIGITS.finditer(run)]
        widths = [b - a for a, b in groups]
        i = 0
        while i < len(groups):
            best = None
            first = widths[i]
            # Cards are one group of 13 to 19 digits or a first group of 4 to 6; and no issuer's prefix starts
            # with 0, 1, 7 or 9: most groups of a long run start no card.
            if run[groups[i][0]] in _CARD_FIRST_DIGITS:
                if 13 <= first <= 19 and card_number_ok(run[groups[i][0]:groups[i][1]]):
                    best = i
                elif 4 <= first <= 6:
                    size = first
                    for j in range(i + 1, len(groups)):
                        if j > i + 1 and not 3 <= widths[j - 1] <= 6:
                            break  # inner groups of a card are 3 to 6 digits
                        size += widths[j]
                        if size > 19:
                            break
                        if size >= 13 and card_number_ok(run[groups[i][0]:groups[j][1]]):
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


# Credentials. Keys and tokens whose issuers give them a fixed prefix, JWTs, the credentials of an HTTP
# Authorization header or after "Bearer", the user:password of a URL, and the value given to a setting named like a
# secret (password, api_key, AWS_SECRET_ACCESS_KEY, 密码...). Each finder starts at a literal or a short
# alternation the regular expression engine scans for quickly, and reads a bounded stretch from there: linear.
_TOKEN_BEFORE = r"(?<![A-Za-z0-9_\-])"  # not inside a longer word or token
_API_KEY = re.compile(_TOKEN_BEFORE + r"(?:"
                      r"sk-[A-Za-z0-9_\-]{20,}"  # OpenAI (sk-, sk-proj-, sk-svcacct-), Anthropic (sk-ant-), others
                      r"|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe secret and restricted keys
                      r"|(?:AKIA|ASIA)[A-Z0-9]{16}"  # AWS access key ids (long-term, temporary)
                      r"|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,}"  # GitHub tokens
                      r"|xox[abprs]-[A-Za-z0-9\-]{10,}"  # Slack tokens
                      r"|hf_[A-Za-z0-9]{30,}"  # Hugging Face tokens
                      r"|AIza[A-Za-z0-9_\-]{35}"  # Google API keys
                      r")(?![A-Za-z0-9_\-])")
_JWT = re.compile(_TOKEN_BEFORE + r"eyJ[A-Za-z0-9_\-]{10,}\.[A-Za-z0-9_\-]{2,}\.[A-Za-z0-9_\-]*")  # base64url '{"'
_TOKEN68 = r"[A-Za-z0-9\-._~+/]{8,}=*"  # RFC 7235's credentials characters
_BEARER = re.compile(_TOKEN_BEFORE + rf"(?:Bearer|BEARER|bearer)[ \t]+({_TOKEN68})")
_AUTHORIZATION = re.compile(  # the header's credentials, whatever the scheme: "Authorization: Basic dXNl..."
    rf"(?i:authorization)[\"']?[ \t]*[:=][ \t]*[\"']?(?:[A-Za-z][A-Za-z0-9\-]*[ \t]+)?({_TOKEN68})")
# A URL's authority: what follows "://" up to the path, in the characters RFC 3986 allows there.
_AUTHORITY = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:%@]{3,}")
# A setting named like a secret, then ":" or "=" (quoted keys, JSON, YAML, .env, HTTP headers, Python) or "is", then
# the value: quoted (up to 256 characters) or a run of printable ASCII. Named after a non-letter ("DB_PASSWORD" counts,
# "bypassword" does not); "token" and "key" alone are too common (max_tokens, eos_token, dictionary keys) to count.
_SECRET_NAME = (r"(?i:pass(?:word|wd|phrase)|client[_\-]?secret|secret(?:[_\-]?access)?(?:[_\-]?key)?"
                r"|(?:api|access|private)[_\-]?key(?:[_\-]?id)?|apikey"
                r"|(?:auth|access|refresh|session|bearer|api|id)[_\-]?token)")
_UNQUOTED = r"[^\s\"'`,;<>(){}\[\]=\x7f-\U0010ffff][^\s\"'`,;<>(){}\[\]\x7f-\U0010ffff]*"
_SECRET_SETTING = re.compile(
    rf"(?<![A-Za-z0-9]){_SECRET_NAME}(?:[\"']?[ \t]*(?::=|=>|[:=])|[ \t]+(?P<verb>is|was)(?:[ \t]*:)?)[ \t]*"
    rf"(?:(?P<quote>[\"'`])(?P<quoted>[^\r\n]{{1,256}}?)(?P=quote)|[\"'`]?(?P<plain>{_UNQUOTED}))")
_SECRET_SETTING_ZH = re.compile(rf"(?:密码|口令|密钥|秘钥)[ \t]*(?:[:：=]|是|为)[ \t]*(?P<plain>{_UNQUOTED})")
_PROSE_GOES_ON = re.compile(r"[ \t]+[a-z]")


def _looks_random(token: str) -> bool:
    """Whether a word after "Bearer" or "Authorization:" is a credential rather than prose: a digit, a symbol
    words do not hold, or mixed case in a long run (base64). "bearer instruments", "Authorization: required" are not."""
    token = token.rstrip(".")
    return (any(c.isdigit() or c in "+/=_~" for c in token)
            or (len(token) >= 12 and any(c.isupper() for c in token[1:]) and any(c.islower() for c in token)))


def _password_like(word: str) -> bool:
    """A word that reads as a password after "password is": 6 characters or more, a digit or a symbol among them."""
    return len(word) >= 6 and any(c.isdigit() or not (c.isalpha() or c in "-.") for c in word)


def find_secrets(text: str) -> Iterator[tuple[str, int, int]]:
    """Spans of credentials, as (kind, start, end): ``API_KEY`` (a key or token an issuer marks with its prefix),
    ``ACCESS_TOKEN`` (a JWT, the credentials of an Authorization header or after "Bearer"), ``SECRET`` (the value
    of a setting named like a secret, the user:password of a URL)."""
    for m in _API_KEY.finditer(text):
        if not m.group().startswith("sk-") or _looks_random(m.group()[3:].replace("-", "")):
            yield "API_KEY", m.start(), m.end()  # "sk-" and 20 letters and dashes may be hyphenated words
    if "eyJ" in text:
        yield from (("ACCESS_TOKEN", m.start(), m.end()) for m in _JWT.finditer(text))
    for pattern in (_BEARER, _AUTHORIZATION):
        for m in pattern.finditer(text):
            if _looks_random(m.group(1)):
                yield "ACCESS_TOKEN", m.start(1), m.start(1) + len(m.group(1).rstrip("."))
    yield from (("SECRET", s, e) for s, e in find_url_credentials(text))
    for pattern in (_SECRET_SETTING, _SECRET_SETTING_ZH):
        for m in pattern.finditer(text):
            span = _setting_value(text, m)
            if span is not None:
                yield "SECRET", span[0], span[1]


def find_url_credentials(text: str) -> Iterator[tuple[int, int]]:
    """Spans of the ``user:password`` of URLs (``scheme://user:password@host``); a user name alone is no secret."""
    at = text.find("://")
    while at >= 0:
        m = _AUTHORITY.match(text, at + 3)
        if m is not None:
            userinfo_end = m.group().rfind("@")  # a password may hold an "@" its writer did not escape
            if userinfo_end > 0 and ":" in m.group()[:userinfo_end]:
                yield m.start(), m.start() + userinfo_end
        at = text.find("://", at + 3)


def _setting_value(text: str, m: re.Match) -> tuple[int, int] | None:
    """The span of a secret setting's value, or None where the match is prose or code rather than a value."""
    if m.groupdict().get("quoted"):
        return m.span("quoted")
    value, end = m.group("plain"), m.end("plain")
    if end < len(text) and text[end] in "([":
        return None  # a call or an index: code that reads the secret from elsewhere (getpass(), os.environ[...])
    if text[m.start("plain") - 1] not in "\"'`":
        if m.groupdict().get("verb") and not _password_like(value.rstrip(".")):
            return None  # "the password is too short", "is 8-16 characters": a sentence
        if value.isalpha() and _PROSE_GOES_ON.match(text, end):
            return None  # "Password: must be 8 characters long": a sentence, not a value
    if m.start() and text[m.start() - 1] in "?&" and "&" in value:
        value = value[:value.index("&")]  # a URL's query: the next parameter starts there
        end = m.start("plain") + len(value)
    if value.endswith(".") and (end == len(text) or text[end].isspace()):
        value, end = value[:-1], end - 1  # the end of a sentence
    return (m.start("plain"), end) if value else None


class _Budget:
    """The CPU time one :meth:`Redactor.find` may still spend on the costly finders (phones, IPs, e-mails).

    This thread's CPU time, not the wall clock: a writer thread waiting for the GIL is not charged for it. The
    clock is a system call (~1 us, and a point where a busy machine switches threads): it is read once per 32
    units of work, a unit being roughly what a digit run or an ``@`` costs to check (~10-30 us).
    """

    __slots__ = ("deadline", "_work", "_spent")

    def __init__(self, seconds: float) -> None:
        self.deadline = time.thread_time() + seconds
        self._work = 0
        self._spent = seconds <= 0

    def spent(self, work: int = 1) -> bool:
        if self._spent:
            return True
        self._work += work
        if self._work >= 32:
            self._work = 0
            self._spent = time.thread_time() >= self.deadline
        return self._spent


def _local_char(c: str) -> bool:
    return c in _LOCAL_PUNCT or ((c.isalnum() or "\u0300" <= c <= "\u036f") and not _IS_CJK.match(c))


def _domain_char(c: str) -> bool:
    return c.isalnum() or c in ".-" or "\u0300" <= c <= "\u036f"


def find_emails(text: str, is_domain: Callable[[str], bool],
                budget: _Budget | None = None) -> Iterator[tuple[int, int]]:
    """Spans of e-mail addresses, found from each ``@`` outwards (linear, whatever the text).

    The local part is a run of Latin (or other non-CJK) letters, digits and ``._%+-``, or a run of CJK
    characters: a CJK local part glued to Chinese text takes the whole run, since nothing marks where the
    address starts. ``is_domain`` says whether a host name ends in a public suffix. Once ``budget`` is spent,
    the host is no longer checked: every remaining local part, ``@`` and dotted host is taken for an address.
    """
    checked = True
    for at in (m.start() for m in _AT.finditer(text)):
        if checked and budget is not None and budget.spent():
            checked = False
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
        if not checked:
            host = text[at + 1:end].rstrip(".-")
            if "." in host:
                yield start, at + 1 + len(host)
            continue
        host = _host(text[at + 1:end], is_domain)
        if host:
            yield start, at + 1 + len(host)


# A host is given up after this many suffix look-ups (~3 us each): an address needs one or two, a host of 120
# labels glued to text would need 120.
_MAX_HOST_LOOKUPS = 48
# No public suffix's last label is longer (the bundled list's longest is 18 characters; a test checks it).
_MAX_SUFFIX_LABEL = 24


def _host(candidate: str, is_domain: Callable[[str], bool]) -> str:
    """The longest leading part of ``candidate`` that is a host name under a public suffix, or ''."""
    labels = candidate.rstrip(".-").split(".")
    lookups = 0
    while len(labels) >= 2 and lookups < _MAX_HOST_LOOKUPS:
        if all(lb and lb[0] != "-" and lb[-1] != "-" for lb in labels):
            lookups += 1
            if is_domain(".".join(labels)):
                return ".".join(labels)
            last = labels[-1]
            # A non-ASCII suffix may run into the Chinese that follows it: "中国谢谢", "com谢谢".
            for cut in range(min(len(last) - 1, _MAX_SUFFIX_LABEL), 0, -1) if not last.isascii() else ():
                host = ".".join([*labels[:-1], last[:cut]])
                lookups += 1
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


# Phone numbers.
#
# libphonenumber's PhoneNumberMatcher costs 0.1 to 1.5 ms per region for every digit run it looks at, phone or
# not: run over the whole text for 11 regions it was ~95% of the time redaction took, and 100 KB of digit groups
# took ~20 s. Here a regular expression finds the runs the matcher would look at, each region's metadata says
# (with a few regular expressions) whether any part of a run could be a valid number when parsed for that
# region, and the matcher runs only for the regions that pass, only on the run and the characters around it
# that it reads. For runs of up to 21 digit groups the matches are those of the matcher run on the whole text.

# The characters libphonenumber takes between digit groups ("valid punctuation") and before the first group
# (brackets and plus signs); a test compares them with the library's.
_PHONE_PUNCT = ("-x\u2010-\u2015\u2212\u30fc\uff0d-\uff0f \u00a0\u00ad\u200b\u2060\u3000()\uff08\uff09\uff3b\uff3d"
                ".\\[\\]/~\u2053\u223c\uff5e")
_PHONE_LEAD = "(\\[\uff08\uff3b+\uff0b"
_PHONE_RUN = re.compile(
    rf"(?:[{_PHONE_LEAD}][{_PHONE_PUNCT}]{{0,4}}){{0,2}}\d+(?:[{_PHONE_PUNCT}]{{0,4}}\d+)*", re.IGNORECASE)
_DIGIT_GROUP = re.compile(r"\d+")
_PHONE_START = re.compile("[+\uff0b\\d]")  # where a parse starts reading a number
# An extension after a run ("ext. 12", "x12", "доб 12", " 12#"), in the shapes the matcher takes: it belongs to
# the number before it, where a parse may read its letters as digits (vanity numbers), so no region is ruled out
# for such a run; group 1 is its first digit.
_PHONE_EXT = re.compile(
    r"(?:;ext=|[ \u00a0\t,]*(?:e?xt(?:ensi[o\u00f3]?)?n?|\uff45?\uff58\uff54\uff4e?|доб|anexo|int|\uff49\uff4e\uff54"
    r"|[x\uff58#\uff03~\uff5e])[:.\uff0e]?[ \u00a0\t,-]*|[- ]+(?=\d{1,6}#))(\d)", re.IGNORECASE)
_SECOND_NUMBER = re.compile(r"[\\/] *x")  # a slash and an x: where the matcher ends a candidate, a number follows
_PHONE_BLOCKS = 21  # the matcher's candidates have at most 21 blocks of at most 20 digits
# The most digits a parse can read a valid number from: 17 national digits after up to 10 of prefixes (an
# international prefix and country code, or a country code and national prefixes).
_MAX_PHONE_DIGITS = 28
_PHONE_TYPES = ("premium_rate", "toll_free", "shared_cost", "voip", "personal_number", "pager", "uan",
                "voicemail", "fixed_line", "mobile")
_NP_FIRST_GROUP_ONLY = re.compile(r"\(?\\1\)?")  # a formatting rule that writes no national prefix


def _ascii_digits(digits: str) -> str:
    return digits if digits.isascii() else "".join(str(int(c)) for c in digits)


class _RegionCheck:
    """Whether a libphonenumber parse of a digit string, with this default region, can give a valid number.

    A necessary condition, read from the metadata: the string starts with the region's international prefix
    (then any country's number may follow: yes), or it is a number of one of the types of a region with this
    country code, after the country code and national prefixes it may start with. A number with neither must
    not need the national prefix (at leniency VALID the matcher drops numbers written without a national prefix
    that their format writes). A few regular expressions (~1 us) in place of a parse and a match (~100 us).
    """

    def __init__(self, region: str, intl_fewest: int) -> None:
        import phonenumbers

        self.region = region
        self.intl_fewest = intl_fewest
        meta = phonenumbers.PhoneMetadata.metadata_for_region(region)
        self.any = meta is None  # an unknown region: nothing is ruled out
        if self.any:
            return
        self.cc = str(meta.country_code)
        self.idd = re.compile(meta.international_prefix) if meta.international_prefix else None
        types: list[str] = []
        lengths = []
        for other in phonenumbers.region_codes_for_country_code(meta.country_code):
            m = phonenumbers.PhoneMetadata.metadata_for_region(other)
            if m is None:
                continue
            lengths += [n for n in m.general_desc.possible_length if n > 0]
            types += [d.national_number_pattern for d in (getattr(m, t) for t in _PHONE_TYPES)
                      if d is not None and d.national_number_pattern]
        self.shortest = min(lengths, default=1)
        self.types = re.compile("|".join(f"(?:{p})" for p in types) or "(?!)")
        prefix = meta.national_prefix_for_parsing
        self.prefix = re.compile(prefix) if prefix else None
        self.transform = meta.national_prefix_transform_rule or None
        strip = f"(?:{prefix})?" if prefix else ""
        self.stripped = re.compile(f"{strip}{strip}(?:{self.types.pattern})")
        # Formats of the country's main region whose rule writes the national prefix, and those that do not.
        main = phonenumbers.PhoneMetadata.metadata_for_region(
            phonenumbers.region_code_for_country_code(meta.country_code)) or meta
        needs, free = [], []
        for f in main.number_format:
            rule = f.national_prefix_formatting_rule
            shape = (f"(?=(?:{f.leading_digits_pattern[-1]}))" if f.leading_digits_pattern else "") + f"(?:{f.pattern})"
            needed = bool(rule) and not f.national_prefix_optional_when_formatting and \
                not _NP_FIRST_GROUP_ONLY.fullmatch(rule)
            (needs if needed else free).append(shape)
        self.needs_prefix = re.compile("|".join(needs) or "(?!)")
        self.no_prefix = re.compile("|".join(free) or "(?!)")

    def could_fit(self, width: int) -> bool:
        """Whether a number of ``width`` digits could be read (national, or after an international prefix)."""
        return self.any or width >= self.shortest or (self.idd is not None and width > self.intl_fewest)

    def accepts(self, d: str) -> bool:
        """``d``: ASCII digits, a part of a run that the matcher may parse."""
        if self.any:
            return True
        if self.idd is not None:
            m = self.idd.match(d)
            # A country code never starts with 0, and a country code and number have _INTL_FEWEST digits.
            if m is not None and d[m.end():m.end() + 1] != "0" and len(d) - m.end() >= self.intl_fewest:
                return True
        if len(d) < self.shortest:
            return False
        if d.startswith(self.cc) and self.stripped.fullmatch(d, len(self.cc)):
            return True  # the country code without a plus: no national prefix needed
        if self.prefix is not None and self.prefix.match(d):
            return self.stripped.fullmatch(d) is not None or (self.transform is not None and self._transformed(d))
        return bool(self.types.fullmatch(d)) and (
            self.no_prefix.fullmatch(d) is not None or self.needs_prefix.fullmatch(d) is None)

    def _transformed(self, d: str) -> bool:
        """A national prefix rewritten, not just dropped (a transform rule, as Japan's and Argentina's)."""
        assert self.prefix is not None and self.transform is not None
        heads = [d] + ([d[len(self.cc):]] if d.startswith(self.cc) else [])
        heads += [h[m.end():] for h in heads if (m := self.prefix.match(h))]
        for h in heads:
            m = self.prefix.match(h)
            if m is not None and m.groups() and m.groups()[-1] is not None and \
                    self.stripped.fullmatch(self.prefix.sub(self.transform, h, count=1)):
                return True
        return False


class _PhoneFinder:
    """Phone numbers as libphonenumber's matcher finds them (leniency VALID) for any of ``regions``."""

    def __init__(self, regions: tuple[str, ...]) -> None:
        import phonenumbers

        self.regions = regions
        # The fewest digits of a country code and number (6, a few small territories'): after a plus sign or an
        # international prefix, fewer are nobody's number.
        self._intl_fewest = min(
            len(str(m.country_code)) + min((n for n in m.general_desc.possible_length if n > 0), default=99)
            for m in [*map(phonenumbers.PhoneMetadata.metadata_for_region, phonenumbers.SUPPORTED_REGIONS),
                      *map(phonenumbers.PhoneMetadata.metadata_for_nongeo_region,
                           phonenumbers.COUNTRY_CODES_FOR_NON_GEO_REGIONS)] if m is not None)
        self._checks = [_RegionCheck(r, self._intl_fewest) for r in regions]
        # Fewer digits than this are nobody's number, national or international.
        self._fewest = min([self._intl_fewest, *(2 if c.any else c.shortest for c in self._checks)])
        self._country_codes = frozenset(map(str, phonenumbers.COUNTRY_CODE_TO_REGION_CODE))
        self._match = phonenumbers.PhoneNumberMatcher
        self._valid = phonenumbers.Leniency.VALID
        # The matcher's own patterns, which it keeps private: how it cuts a candidate that is no number into
        # parts to try (without them, no region is ruled out), and the dates it skips whole (a date written with
        # slashes; a date and hour followed by ":MM") (without them, none is).
        from phonenumbers import phonenumbermatcher

        self._inner = getattr(phonenumbermatcher, "_INNER_MATCHES", None)
        self._dates = getattr(phonenumbermatcher, "_SLASH_SEPARATED_DATES", None)
        self._times = getattr(phonenumbermatcher, "_TIME_STAMPS", None)
        self._minutes = getattr(phonenumbermatcher, "_TIME_STAMPS_SUFFIX", None)
        # The same numbers come back (years, times, a phone in every turn of a chat): their answers are kept.
        self._regions = lru_cache(maxsize=8192)(self._regions_uncached)

    def find(self, text: str, budget: _Budget, found: list[tuple[str, int, int]]) -> None:
        """Append phone numbers to ``found``; once ``budget`` is spent, every remaining run of 7 or more digits
        (separators allowed) instead, unchecked: stored masked rather than unread."""
        spans: list[tuple[int, int]] = []
        pos = 0
        while (run := _PHONE_RUN.search(text, pos)) is not None:
            start, end = run.span()
            read_all = False
            if (second := _SECOND_NUMBER.search(text, start, end)) is not None:
                end = second.start()  # the matcher cuts a candidate there, and starts the next one there
            else:
                # An extension ("x12", "ext. 12") belongs to the number before it, and where its digits run on,
                # the matcher goes on after the digits it took: the runs it joins are read as one.
                while (ext := _PHONE_EXT.match(text, end)) is not None:
                    read_all = True
                    end = _PHONE_RUN.match(text, ext.start(1)).end()
            pos = end
            if end - start < self._fewest:  # fewer digits than any number has
                continue
            if budget.spent():
                _mask_digits(text[start:end], start, found)
            else:
                self._run(text, start, end, read_all, budget, spans, found)
        for start, end in _drop_contained(spans):
            if not _not_a_phone(text, start, end):
                found.append(("PHONE_NUMBER", start, end))

    def _run(self, text: str, start: int, end: int, read_all: bool, budget: _Budget,
             spans: list[tuple[int, int]], found: list[tuple[str, int, int]]) -> None:
        """The matcher's finds in ``text[start:end]``, a run, read as its candidates of up to 21 digit groups."""
        s = text[start:end]
        groups = [g.span() for g in _DIGIT_GROUP.finditer(s)]
        chunks, first, blocks = [], 0, 0
        for k, (a, b) in enumerate(groups):
            n = (b - a + 19) // 20
            if k > first and blocks + n > _PHONE_BLOCKS:
                chunks.append((first, k))
                first, blocks = k, 0
            blocks += n
        chunks.append((first, len(groups)))
        for i, (a, b) in enumerate(chunks):
            if i and budget.spent():
                _mask_digits(s[groups[a][0]:], start + groups[a][0], found)
                return
            if sum(g1 - g0 for g0, g1 in groups[a:b]) < self._fewest:
                continue
            cs = start if a == 0 else start + groups[a][0]
            ce = start + groups[b - 1][1]
            if read_all:
                regions, stand_in = self.regions, False
            elif self._skipped(text, cs, ce):
                continue
            else:
                regions, stand_in = self._regions(text[cs:ce])
            if not regions:
                continue
            # The matcher reads the character before a number (a Latin letter there voids it) and up to three
            # after it (the one after, and ":MM" after a time).
            ws, we = max(cs - 1, 0), min(len(text), ce + 3)
            window = text[ws:we]
            asked, whole, found_one = 0, False, False
            for region in regions:
                asked += 1
                for m in self._match(window, region, leniency=self._valid):
                    if cs <= ws + m.start < ce:
                        spans.append((ws + m.start, ws + m.end))
                        found_one = True
                        whole = whole or (ws + m.start == cs and ws + m.end >= ce)
                if whole:  # what the other regions find here lies inside it, and is dropped: not asked
                    break
            if stand_in and found_one and not whole:
                # The first region stood in for all on a number after a plus sign; each region goes on after
                # it, and what follows may be a number for some region only: all are asked.
                for region in self.regions:
                    if region not in regions:
                        asked += 1
                        spans.extend((ws + m.start, ws + m.end)
                                     for m in self._match(window, region, leniency=self._valid)
                                     if cs <= ws + m.start < ce)
            budget.spent(8 * asked * (b - a))  # a match attempt: ~0.1 ms per region and digit group

    def _skipped(self, text: str, start: int, end: int) -> bool:
        """Whether the matcher skips the candidate ``text[start:end]`` whole (a date), for every region."""
        if self._dates is None or self._times is None or self._minutes is None:
            return False
        candidate = text[start:end]
        if "x" in candidate or "X" in candidate:  # "/x" may cut the candidate short: not the same text then
            return False
        return bool(self._dates.search(candidate) or (
            self._times.search(candidate) and self._minutes.match(text, end)))

    def _regions_uncached(self, candidate: str) -> tuple[tuple[str, ...], bool]:
        """The regions for which a part of ``candidate`` that the matcher parses passes the metadata check,
        and whether the first region stands in for all on a part after a plus sign.

        The parts are the candidate and what the matcher cuts from it when it is no number (at slashes,
        brackets, dashes, dots, spaces: its own patterns for that); a match later in the candidate comes after
        a first one, for a region that is asked already. A parse reads the digits, those before an "x" or a "~"
        (an extension), or, with three letters, letters as digits (then no region is ruled out).
        """
        if self._inner is None:
            return self.regions, False
        left = list(self._checks)
        asked: set[str] = set()
        seen: set[tuple[str, bool]] = set()
        stand_in = False
        for piece in self._pieces(candidate):
            if sum(c in "xX" for c in piece) >= 3:
                return self.regions, False
            lead = _PHONE_START.search(piece)
            plus = lead is not None and lead.group() in "+\uff0b"
            cuts = [k for k, c in enumerate(piece) if c in "xX~\uff5e"]  # where an extension may start
            for part in (piece, *(piece[:k] for k in cuts)):
                d = _ascii_digits("".join(_DIGIT_GROUP.findall(part)))
                if not self._fewest <= len(d) <= _MAX_PHONE_DIGITS or (d, plus) in seen:
                    continue
                seen.add((d, plus))
                if plus and any(d[:k] in self._country_codes for k in (1, 2, 3)):
                    # After a plus sign and a country code the parse does not depend on the region: one region
                    # finds it. (After a plus and no country code it is parsed again as a national number.)
                    if len(d) >= self._intl_fewest:
                        asked.add(self.regions[0])
                        stand_in = True
                    continue
                asked.update(c.region for c in left if c.could_fit(len(d)) and c.accepts(d))
                left = [c for c in left if c.region not in asked]
                if not left:
                    return self.regions, False
        return tuple(r for r in self.regions if r in asked), stand_in

    def _pieces(self, candidate: str) -> Iterator[str]:
        """The candidate, then the parts the matcher tries when it is no number, in the matcher's order."""
        assert self._inner is not None
        yield candidate
        if candidate.isdigit():  # nothing to cut at
            return
        for pattern in self._inner:
            m = pattern.search(candidate)
            if m is not None:
                yield candidate[:m.start()]
            while m is not None:
                yield m.group(1)
                m = pattern.search(candidate, m.start() + 1)


def _mask_digits(run: str, start: int, found: list[tuple[str, int, int]]) -> None:
    """The conservative stand-in for an unchecked run: masked if it holds 7 digits or more."""
    if sum(map(len, _DIGIT_GROUP.findall(run))) >= 7:
        found.append(("UNCHECKED_NUMBER", start, start + len(run)))


def _drop_contained(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Distinct spans, less those inside another (as Presidio's recognizers return theirs)."""
    kept: list[tuple[int, int]] = []
    around: list[tuple[int, int]] = []  # kept spans that reach the current start: the only ones that can hold it
    for start, end in sorted(set(spans), key=lambda s: (s[0], -s[1])):
        around = [(s, e) for s, e in around if e >= start]
        if not any(e >= end for _, e in around):
            kept.append((start, end))
            around.append((start, end))
    return kept


# IP addresses: Presidio's IpRecognizer patterns, run only on the tokens that could hold an address (a dotted
# digit or two colons), with the text around them visible to their look-behinds. Over the whole text they cost
# ~0.2-0.3 ms per KB, and Presidio builds a result with an explanation for every match.
# A dot between digits, or two colons with up to four hex digits between them (every IPv6 address has them);
# written to start with the dot or colon, which the regular expression engine scans for quickly.
_IP_SEED = re.compile(r"[.:](?:(?<=\d\.)(?=\d)|(?<=:)[0-9A-Fa-f]{0,4}:)")
_IP_TOKEN = re.compile(r"[0-9A-Za-z_.:%/]*")
_IP_TOKEN_CHARS = frozenset("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_.:%/")
_IP_SHAPE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}|(?:[0-9A-Fa-f]{0,4}:){2,}")


class _IpFinder:
    """IP addresses as Presidio's IpRecognizer finds them (its patterns and its check of each match)."""

    def __init__(self, recognizer, flags: int) -> None:
        import regex

        self._recognizer = recognizer
        self._patterns = [(regex.compile(p.regex, flags), p.score) for p in recognizer.patterns]

    def find(self, text: str, budget: _Budget, found: list[tuple[str, int, int]]) -> None:
        """Append IP addresses to ``found``; once ``budget`` is spent, every remaining token shaped like one."""
        pos = 0
        while (seed := _IP_SEED.search(text, pos)) is not None:
            start = seed.start()
            while start > pos and text[start - 1] in _IP_TOKEN_CHARS:
                start -= 1
            end = _IP_TOKEN.match(text, seed.start()).end()
            pos = max(end, seed.end())
            unchecked = budget.spent() or not self._token(text, start, end, budget, found)
            if unchecked and _IP_SHAPE.search(text, start, end):
                found.append(("IP_ADDRESS", start, end))

    def _token(self, text: str, start: int, end: int, budget: _Budget, found: list[tuple[str, int, int]]) -> bool:
        """Addresses in ``text[start:end]``, a token; False if the budget ran out first.

        An address is made of token characters only, so it lies inside the token: the patterns run on it alone,
        their look-behinds seeing the text before it, their look-aheads the token's end (as good as the
        character after it, which is no token character).
        """
        rec = self._recognizer
        for pattern, score in self._patterns:
            for m in pattern.finditer(text, start, end):
                if budget.spent():
                    return False
                s = m.group()
                if not s:
                    continue
                valid = rec.validate_result(s)  # as Presidio scores a match: None keeps the pattern's score
                if (score if valid is None else float(valid)) > 0 and not rec.invalidate_result(s):
                    found.append(("IP_ADDRESS", m.start(), m.end()))
        return True


# Which of two results for the same text wins: a key by its issuer's prefix or a token before what else it reads as
# ("OPENAI_API_KEY=sk-..." is a SECRET too), then the checksummed kinds before the looser ones.
_RANK = {"API_KEY": 5, "ACCESS_TOKEN": 5, "CN_RESIDENT_ID": 4, "CREDIT_CARD": 3, "EMAIL_ADDRESS": 3, "SECRET": 3,
         "CN_RESIDENT_ID_15": 2, "IP_ADDRESS": 1,
         "PHONE_NUMBER": 0, "UNCHECKED_NUMBER": -1}


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


def _dotted(host: str) -> bool:
    return "." in host.strip(".")


def find_own(text: str, is_domain: Callable[[str], bool], budget: _Budget | None = None) -> list[tuple[str, int, int]]:
    """What this module finds on its own, no extra needed: payment cards, resident IDs, credentials, e-mail addresses
    (``is_domain`` judges their hosts), as (kind, start, end), overlaps not yet resolved."""
    found: list[tuple[str, int, int]] = [("CREDIT_CARD", s, e) for s, e in find_cards(text)]
    found.extend(("CN_RESIDENT_ID" if full else "CN_RESIDENT_ID_15", s, e) for s, e, full in find_cn_ids(text))
    secrets = list(find_secrets(text))
    found.extend(secrets)
    if "@" in text or "\uff20" in text:
        # The password of "scheme://user:password@host" (or a token: "https://ghp_...@github.com") reads as an
        # e-mail's local part: it is redacted as what it is, and the host stays. (A local part holds no "@": the
        # first one in an address is its own.)
        userinfo_ends = {e for _, _, e in secrets if text.startswith("@", e)}
        found.extend(("EMAIL_ADDRESS", s, e) for s, e in find_emails(text, is_domain, budget)
                     if text.find("@", s, e) not in userinfo_ends)
    return found


def mask_plain(text: str) -> str:
    """``text`` with what this module finds on its own masked (``find_own``, any dotted host taken for a domain).
    For short texts a client wrote that a record keeps without text storage: an error message quotes the model
    name, field name or ``logit_bias`` key the client sent. Phone numbers need libphonenumber, an extra, and are not
    looked for."""
    found = find_own(text, _dotted)
    if not found:
        return text
    out, last = [], 0
    for kind, start, end in _resolve(found):
        out += [text[last:start], f"<{kind.removesuffix('_15')}>"]
        last = end
    out.append(text[last:])
    return "".join(out)


class Redactor:
    """Find and replace personal data: ``redact("邮箱 a@b.com")`` -> ``"邮箱 <EMAIL_ADDRESS>"``.

    Construction imports Presidio (a few seconds: it pulls in spaCy); do it once at start-up, off the event loop.
    Thread-safe for concurrent ``redact`` calls: the finders hold no per-call state.

    Cost: a call may spend ``budget_ms`` plus ``budget_ms_per_kchar`` per 1,000 characters of its thread's CPU
    time (by default 5 + 1.5: 20 ms for 10 KB of ASCII text; prose takes ~0.1-0.3 ms per 1,000 characters, text
    dense with phone numbers ~3). Cards, resident IDs and credentials are always checked (linear, ~0.5 ms per
    1,000 characters at worst), phone numbers, IP addresses and e-mail hosts while the budget lasts; after it, what
    could be one of those is masked unchecked instead: every run of 7 or more digits with the separators phone
    numbers use (``<UNCHECKED_NUMBER>``), every token shaped like an IP address, every ``local@dotted.host``.
    """

    def __init__(self, phone_regions: tuple[str, ...] = DEFAULT_PHONE_REGIONS, *, budget_ms: float = 5.0,
                 budget_ms_per_kchar: float = 1.5) -> None:
        self.phone_regions = phone_regions
        self.budget_ms = budget_ms
        self.budget_ms_per_kchar = budget_ms_per_kchar
        check_available()
        try:
            _ = self._phones  # import and build now, not on the first request
            _ = self._ips
            _ = self._anonymizer
            _ = self._is_domain
        except ImportError as exc:  # a partial or broken install
            raise RedactionUnavailable(
                f"--store-text needs Presidio, which failed to import ({exc}); reinstall it with: "
                f"pip install 'tailguard[redaction]'") from exc

    @cached_property
    def _phones(self) -> _PhoneFinder:
        return _PhoneFinder(self.phone_regions)

    @cached_property
    def _ips(self) -> _IpFinder:
        import regex
        from presidio_analyzer.predefined_recognizers import IpRecognizer

        # Presidio matches with the third-party ``regex`` module, whose flag values differ from ``re``'s;
        # ASCII, so that ``\b`` fires between Han characters and an address.
        return _IpFinder(IpRecognizer(), regex.DOTALL | regex.MULTILINE | regex.IGNORECASE | regex.ASCII)

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

        budget = _Budget((self.budget_ms + self.budget_ms_per_kchar * len(text) / 1000) / 1000)
        found = find_own(text, self._is_domain, budget)
        self._ips.find(text, budget, found)
        self._phones.find(text, budget, found)
        return [RecognizerResult(kind.removesuffix("_15"), start, end, 0.5 + _RANK[kind] / 10)
                for kind, start, end in _resolve(found)]

    def redact(self, text: str | None) -> str | None:
        if not text:
            return text
        results = self.find(text)
        if not results:
            return text
        return self._anonymizer.anonymize(text=text, analyzer_results=results).text
