"""Keeping secrets out of the bench's outputs: the API key, header values and URL credentials.

The command line is recorded (so that a run can be repeated) with the value of ``--api-key`` and of every
credential-bearing ``--header`` (Authorization, Cookie, or a name with key, token, secret, auth...) masked, and the password and secret-looking query parameters of a URL masked. As a second line of
defence, every string that goes into ``results.json``, ``requests.csv``, ``report.html`` or the printed summary is
scrubbed of the run's secret values, in case a server echoes one back in an error message.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tailguard.urls import MASK, redact_url
from tailguard.urls import SECRET_PARAM_WORDS as _SECRET_PARAM_WORDS

SECRET_FLAGS = ("--api-key",)
HEADER_FLAGS = ("--header",)
CLASS_FLAGS = ("--class",)  # name=vip,key=sk-...,header=X-Api-Key:...: the key and credential headers masked
# bench ab: NAME=VALUE, the value masked (a key), a header's value masked, or a URL / a command redacted
ARM_KEY_FLAGS = ("--arm-key",)
ARM_HEADER_FLAGS = ("--arm-header",)
ARM_FLAGS = ("--arm",)


def secret_header(name: str) -> bool:
    """Authorization, Cookie, X-Api-Key, X-Auth-Token, ...: a header whose value is a credential."""
    n = name.strip().lower()
    return n in ("authorization", "proxy-authorization", "cookie") or any(w in n for w in _SECRET_PARAM_WORDS)


def _mask_header(value: str) -> str:
    name, sep, _ = value.partition(":")
    if not sep:
        return MASK
    return f"{name}:{MASK}" if secret_header(name) else value


def _mask_class(value: str) -> str:
    parts = []
    for part in value.split(","):
        k, eq, v = part.partition("=")
        name = k.strip().lower().replace("_", "-")
        if eq and name in ("key", "api-key"):
            part = f"{k}={MASK}"
        elif eq and name in ("header", "headers"):
            part = f"{k}={_mask_header(v)}"
        parts.append(part)
    return ",".join(parts)


def _mask_arm(flag: str, value: str) -> str:
    """``before=sk-1`` (--arm-key) -> ``before=***``; ``b=X-Api-Key:v`` (--arm-header) -> ``b=X-Api-Key:***``;
    ``b=http://u:pw@h`` or ``b=cmd:serve --api-key k`` (--arm) -> the URL redacted, the command's secrets masked."""
    name, eq, rest = value.partition("=")
    if not eq:
        return MASK if flag in ARM_KEY_FLAGS else value
    if flag in ARM_KEY_FLAGS:
        return f"{name}={MASK}"
    if flag in ARM_HEADER_FLAGS:
        return f"{name}={_mask_header(rest)}"
    if rest.startswith("cmd:"):
        try:
            return f"{name}=cmd:{shlex.join(redact_argv(shlex.split(rest[4:])))}"
        except ValueError:  # unbalanced quotes: the bench refuses it anyway
            return f"{name}=cmd:{MASK}"
    return f"{name}={redact_url(rest)}"


_ARM_ANY = ARM_KEY_FLAGS + ARM_HEADER_FLAGS + ARM_FLAGS


def redact_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the API key and header values masked and URLs redacted."""
    out: list[str] = []
    mask_next: str | None = None
    for a in argv:
        if mask_next is not None:
            out.append(_mask_header(a) if mask_next in HEADER_FLAGS else _mask_class(a) if mask_next in CLASS_FLAGS
                       else _mask_arm(mask_next, a) if mask_next in _ARM_ANY else MASK)
            mask_next = None
            continue
        flag, eq, value = a.partition("=")
        if flag in _ARM_ANY:
            if eq:
                out.append(f"{flag}={_mask_arm(flag, value)}")
            else:
                out.append(a)
                mask_next = flag
            continue
        if flag in CLASS_FLAGS:
            if eq:
                out.append(f"{flag}={_mask_class(value)}")
            else:
                out.append(a)
                mask_next = flag
            continue
        if flag in SECRET_FLAGS or flag in HEADER_FLAGS:
            if eq:
                out.append(f"{flag}={_mask_header(value) if flag in HEADER_FLAGS else MASK}")
            else:
                out.append(a)
                mask_next = flag
            continue
        out.append(redact_url(a) if "://" in a else a)
    return out


def command_line(argv: Iterable[str]) -> str:
    """The redacted command, quoted so that it can be pasted back into a shell."""
    return shlex.join(redact_argv(argv))


def secret_values(api_key: str | None, headers: dict[str, str] | None, url: str | None) -> list[str]:
    """The strings that must appear in no output (longest first, so that a key inside a header goes whole)."""
    vals = set()
    if api_key:
        vals.add(api_key)
    for k, v in (headers or {}).items():
        v = v.strip()
        if not secret_header(k):
            continue
        if v:
            vals.add(v)
            for part in v.split():  # "Bearer sk-...": the token alone is the secret too
                if len(part) >= 8:
                    vals.add(part)
    if url:
        try:
            u = urlsplit(url)
            if u.password:
                vals.add(u.password)
            for k, v in parse_qsl(u.query):
                if v and any(w in k.lower() for w in _SECRET_PARAM_WORDS):
                    vals.add(v)
        except ValueError:
            pass
    # a very short value (a one-letter header) would mask innocent text everywhere: it is masked in the command only
    return sorted((v for v in vals if len(v) >= 4), key=len, reverse=True)


def scrub(obj: Any, secrets: list[str]) -> Any:
    """``obj`` with every occurrence of each secret in its strings (and dict keys) replaced by ``***``."""
    if not secrets:
        return obj
    if isinstance(obj, str):
        for s in secrets:
            if s in obj:
                obj = obj.replace(s, MASK)
        return obj
    if isinstance(obj, dict):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v, secrets) for v in obj]
    if isinstance(obj, tuple):
        return tuple(scrub(v, secrets) for v in obj)
    return obj
