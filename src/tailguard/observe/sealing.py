"""What a request's rebuild needs, kept sealed: its token ids (the prompt after the chat template and the answer), its
whole sampling parameters and the random seed it ran with, encrypted under a key the operator holds.

Token ids spell out the prompt, personal data included, so they are never stored in the clear: with a sealing key
(``--seal-key-file``, or ``TAILGUARD_SEAL_KEY``) the store keeps them as one Fernet token (AES-128-CBC with an
HMAC-SHA256, from the ``cryptography`` package) in the record's ``sealed`` field; without the key they are noise,
and without a key configured nothing is kept. ``tailguard rebuild`` opens them with the same key.

A request that samples without a seed is given one when sealing is on (drawn at random, so its answers are as random
as before) and that seed is sealed with it: its computation can then be run again token for token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken

from tailguard.engine.sequence import SamplingParams
from tailguard.engine.structured import StructuredOutput

KEY_ENV = "TAILGUARD_SEAL_KEY"


class SealError(ValueError):
    pass


def new_key() -> str:
    """A fresh sealing key (URL-safe base64 of 32 random bytes), for the operator to keep."""
    return Fernet.generate_key().decode()


def load_key(path: str | None = None) -> str | None:
    """The sealing key from a file (its first line), else from ``TAILGUARD_SEAL_KEY``; None if neither is set."""
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as exc:
            raise SealError(f"cannot read the sealing key file {path}: {exc.strerror}") from None
        if not text:
            raise SealError(f"the sealing key file {path} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get(KEY_ENV) or None


def sampling_to_json(s: SamplingParams) -> dict[str, Any]:
    """Every field of the sampling parameters, as JSON takes it: a rebuild runs the request with exactly these."""
    out = {k: getattr(s, k) for k in s.__dataclass_fields__}
    if s.logit_bias is not None:
        out["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    if s.structured is not None:
        out["structured"] = {"kind": s.structured.kind, "spec": s.structured.spec}
    return out


def sampling_from_json(data: dict[str, Any]) -> SamplingParams:
    known = {k: v for k, v in data.items() if k in SamplingParams.__dataclass_fields__}
    if known.get("logit_bias") is not None:
        known["logit_bias"] = {int(k): float(v) for k, v in known["logit_bias"].items()}
    if known.get("structured") is not None:
        known["structured"] = StructuredOutput(**known["structured"])
    return SamplingParams(**known)


class TokenSeal:
    """Seals and opens rebuild payloads (JSON objects) under one key."""

    def __init__(self, key: str) -> None:
        try:
            self._fernet = Fernet(key.encode() if isinstance(key, str) else key)
        except (ValueError, TypeError):
            raise SealError("a sealing key is 32 bytes in URL-safe base64 (make one with `tailguard rebuild "
                            "--new-key`)") from None

    def seal(self, payload: dict[str, Any]) -> str:
        return self._fernet.encrypt(json.dumps(payload, separators=(",", ":")).encode()).decode()

    def open(self, sealed: str) -> dict[str, Any]:
        try:
            return json.loads(self._fernet.decrypt(sealed.encode()))
        except InvalidToken:
            raise SealError("this key does not open the record's sealed tokens (another key sealed them, or they "
                            "were altered)") from None
