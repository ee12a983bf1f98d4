"""Redaction of personal data before any text is stored (``--store-text``), with Presidio's pattern recognizers.

Presidio's pattern recognizers need no NLP model, so this works offline. We use its recognizers for e-mail, phone
(Google's libphonenumber, Chinese mobiles included), IP and card numbers (Luhn-checked), add one for Chinese resident
ID numbers (ISO 7064 MOD 11-2 checksum) and let Presidio's anonymizer resolve overlaps and replace the spans.

Two adjustments, both for offline, CJK-mixed text:
- Regexes run with the ASCII flag (of the ``regex`` module Presidio matches with): Python treats Han characters as word characters, so ``\\b`` never fires between
  "卡号" and "4111..." and a card number glued to Chinese text would slip through.
- The e-mail recognizer's domain check uses tldextract's bundled suffix list, never a download.

Presidio (which pulls in spaCy) is an optional extra, ``pip install 'tailguard[redaction]'``, needed only for
``--store-text``: it is imported when a :class:`Redactor` is built, never by importing this module.
"""

from __future__ import annotations

from functools import cached_property

_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"

DEFAULT_PHONE_REGIONS = ("CN", "HK", "TW", "SG", "US", "GB", "DE", "FR", "JP", "KR", "IN")
_REQUIRED = ("presidio_analyzer", "presidio_anonymizer", "tldextract", "regex")


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


def cn_id_checksum_ok(number: str) -> bool:
    """True when an 18-character Chinese resident ID has a valid birth date and MOD 11-2 check character."""
    s = number.upper()
    if len(s) != 18 or not s[:17].isdigit():
        return False
    month, day = int(s[10:12]), int(s[12:14])
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return False
    total = sum(int(c) * w for c, w in zip(s[:17], _ID_WEIGHTS))
    return _ID_CHECK[total % 11] == s[17]


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
        except ImportError as exc:  # a partial or broken install
            raise RedactionUnavailable(
                f"--store-text needs Presidio, which failed to import ({exc}); reinstall it with: "
                f"pip install 'tailguard[redaction]'") from exc

    @cached_property
    def _recognizers(self) -> list:
        import regex
        import tldextract
        from presidio_analyzer import Pattern, PatternRecognizer
        from presidio_analyzer.predefined_recognizers import (
            CreditCardRecognizer,
            EmailRecognizer,
            IpRecognizer,
            PhoneRecognizer,
        )

        offline_tlds = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

        class OfflineEmailRecognizer(EmailRecognizer):
            def validate_result(self, pattern_text: str) -> bool:
                return offline_tlds(pattern_text).fqdn != ""

        class ChineseIdRecognizer(PatternRecognizer):
            PATTERN = r"(?<![0-9A-Za-z])[1-9]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx](?![0-9A-Za-z])"

            def __init__(self) -> None:
                super().__init__(
                    supported_entity="CN_RESIDENT_ID",
                    patterns=[Pattern("cn resident id (18)", self.PATTERN, 0.5)],
                    context=["身份证", "id"],
                    supported_language="en",
                )

            def validate_result(self, pattern_text: str) -> bool:
                return cn_id_checksum_ok(pattern_text)

        # Presidio matches with the third-party ``regex`` module, whose flag values differ from ``re``'s.
        self._flags = regex.DOTALL | regex.MULTILINE | regex.IGNORECASE | regex.ASCII
        return [
            OfflineEmailRecognizer(),
            PhoneRecognizer(supported_regions=self.phone_regions),
            IpRecognizer(),
            CreditCardRecognizer(),
            ChineseIdRecognizer(),
        ]

    @cached_property
    def _anonymizer(self):
        from presidio_anonymizer import AnonymizerEngine

        return AnonymizerEngine()

    def find(self, text: str) -> list:
        """Presidio RecognizerResults for every personal-data span in ``text``."""
        results = []
        for rec in self._recognizers:
            if hasattr(rec, "patterns"):
                found = rec.analyze(text, rec.supported_entities, None, regex_flags=self._flags)
            else:
                found = rec.analyze(text, rec.supported_entities, None)
            results.extend(r for r in found or [] if r.score > 0)
        return results

    def redact(self, text: str | None) -> str | None:
        if not text:
            return text
        results = self.find(text)
        if not results:
            return text
        return self._anonymizer.anonymize(text=text, analyzer_results=results).text
