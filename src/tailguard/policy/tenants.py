"""Tenants bound to API keys, and their rate limits.

A key file (YAML) maps hashed API keys to a tenant, and each tenant to a lane::

    tenants:
      acme:   {lane: vip, requests_per_s: 20, tokens_per_s: 20000}
      crawler: {lane: batch}
    keys:
      - {sha256: 9f86d0..., tenant: acme}    # `tailguard keys add` writes these; the key itself is never stored

The lane is a property of the credential: no request header can claim one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

KEY_PREFIX = "tg-"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}|[0-9]{1,6}")


def hash_key(key: str) -> str:
    """The stored form of an API key: SHA-256 of the key (keys are random 256-bit strings, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyFileError(ValueError):
    """A key file that cannot be used, said in one line that never quotes the file's values (they may be secrets)."""


def describe_validation(exc: ValidationError) -> str:
    """A pydantic error as one line, without the input values (a misplaced secret must not be echoed)."""
    parts = []
    errors = exc.errors(include_input=False, include_url=False)
    for err in errors[:3]:
        # A location is a field name or a mapping key of the file, which could itself be a secret (a key pasted
        # where a name goes, a line of some other file): only names that look like setting names are shown.
        where = ".".join(str(p) if _NAME.fullmatch(str(p)) else "(an entry)" for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return "; ".join(parts)


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """Where and what, without the excerpt of the file PyYAML adds (a line of it could be a secret)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "not valid YAML"
    return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None \
        else f"not valid YAML: {problem}"


class TenantConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lane: str = "standard"
    requests_per_s: float | None = Field(None, gt=0, description="sustained request rate; None = unlimited")
    tokens_per_s: float | None = Field(None, gt=0, description="sustained prompt + output tokens; None = unlimited")
    burst_s: float = Field(2.0, gt=0, description="bucket depth, in seconds of the sustained rate")


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sha256: str
    tenant: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        v = v.strip().lower()
        if len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
            raise ValueError("sha256 must be 64 hex digits (the SHA-256 of the key; `tailguard keys add` writes it)")
        return v


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[KeyEntry] = Field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path, missing_ok: bool = False) -> KeyFile:
        """The key file at ``path``; a missing one is an error unless ``missing_ok`` (``keys add`` creates it): a
        server must never take a mistyped path for "no keys". Raises KeyFileError or OSError."""
        p = Path(path)
        if not p.exists():
            if missing_ok:
                return cls()
            raise KeyFileError(f"{path}: no such key file (`tailguard keys add --file {path}` creates one)")
        if p.is_dir():
            raise KeyFileError(f"{path}: is a directory, not a key file")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise KeyFileError(f"{path}: {describe_yaml_error(exc)}") from None
        except UnicodeDecodeError:
            raise KeyFileError(f"{path}: not a text file (a key file is YAML)") from None
        if not isinstance(data, dict):
            raise KeyFileError(f"{path}: a key file is a mapping with 'tenants' and 'keys'")
        try:
            kf = cls.model_validate(data)
        except ValidationError as exc:
            raise KeyFileError(f"{path}: not a key file: {describe_validation(exc)}") from None
        for entry in kf.keys:
            if entry.tenant not in kf.tenants:
                raise KeyFileError(f"{path}: key {entry.sha256[:8]}... names tenant {entry.tenant!r}, which is not "
                                   f"declared under 'tenants'")
        return kf

    def save(self, path: str | Path) -> None:
        """Write atomically: a temporary file of its own (never a fixed name another writer shares), then rename."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    @contextlib.contextmanager
    def updating(cls, path: str | Path) -> Iterator[KeyFile]:
        """Load, change and save the key file under an exclusive lock, so that writers at once (a script adding keys
        in parallel) each keep their key: without it, each would save what it read and drop the others'."""
        p = Path(path)
        for parent in p.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise KeyFileError(f"{path}: {parent} is not a directory")
                break
        p.parent.mkdir(parents=True, exist_ok=True)
        # A lock file beside it: the key file itself is replaced on every save, so a lock on it would not hold.
        with open(p.with_name(p.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                kf = cls.load(p, missing_ok=True)
                yield kf
                kf.save(p)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def add_key(self, tenant: str, lane: str | None = None, **limits: Any) -> str:
        """Create a key for ``tenant`` (declaring the tenant if new); returns the key, which is stored only hashed.
        Raises KeyFileError for a limit that is not a positive number."""
        try:
            if tenant not in self.tenants:
                self.tenants[tenant] = TenantConfig(lane=lane or "standard", **limits)
            elif lane is not None or limits:
                cur = self.tenants[tenant].model_dump()
                cur.update({k: v for k, v in limits.items() if v is not None})
                if lane is not None:
                    cur["lane"] = lane
                self.tenants[tenant] = TenantConfig(**cur)
        except ValidationError as exc:
            raise KeyFileError(describe_validation(exc)) from None
        key = new_key()
        self.keys.append(KeyEntry(sha256=hash_key(key), tenant=tenant))
        return key


class TokenBucket:
    """``rate`` units per second, up to ``capacity`` saved up. ``take`` returns 0 or the seconds until it would fit."""

    __slots__ = ("rate", "capacity", "level", "updated")

    def __init__(self, rate: float, capacity: float, now: float | None = None) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self.updated = time.monotonic() if now is None else now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, amount: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._refill(now)
        # A request larger than the whole bucket may go when the bucket is full (else it could never go).
        amount = min(amount, self.capacity)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class RateLimited(Exception):
    def __init__(self, what: str, retry_after: float) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after = max(1, math.ceil(retry_after))


class Tenant:
    def __init__(self, name: str, cfg: TenantConfig, now: float | None = None) -> None:
        self.name = name
        self.lane = cfg.lane
        self.requests = TokenBucket(cfg.requests_per_s, cfg.requests_per_s * cfg.burst_s, now) \
            if cfg.requests_per_s else None
        self.tokens = TokenBucket(cfg.tokens_per_s, cfg.tokens_per_s * cfg.burst_s, now) if cfg.tokens_per_s else None

    def charge(self, tokens: int, now: float | None = None) -> None:
        """Take one request and ``tokens`` (prompt + requested output) from the tenant's buckets, or raise."""
        now = time.monotonic() if now is None else now
        if self.requests is not None:
            wait = self.requests.take(1, now)
            if wait:
                raise RateLimited(f"tenant {self.name!r} is over its request rate "
                                  f"({self.requests.rate:g} requests/s)", wait)
        if self.tokens is not None:
            wait = self.tokens.take(tokens, now)
            if wait:
                if self.requests is not None:
                    self.requests.give_back(1)
                raise RateLimited(f"tenant {self.name!r} is over its token rate ({self.tokens.rate:g} tokens/s)",
                                  wait)

    def refund(self, tokens: int) -> None:
        """Output tokens charged but never produced (the request stopped early) go back to the bucket."""
        if self.tokens is not None and tokens > 0:
            self.tokens.give_back(tokens)


class Tenants:
    """API key -> tenant, from the key file. Lookups hash the presented key; keys are never kept in memory."""

    def __init__(self, keyfile: KeyFile) -> None:
        self.by_name = {name: Tenant(name, cfg) for name, cfg in keyfile.tenants.items()}
        self._by_hash = {e.sha256: self.by_name[e.tenant] for e in keyfile.keys}

    @classmethod
    def load(cls, path: str | Path | None) -> Tenants | None:
        """The key file's table, or None when no key file is configured. A configured file that is missing raises;
        one without keys gives an empty table, which admits no one (never "no authentication")."""
        return cls(KeyFile.load(path)) if path else None

    def lookup(self, key: bytes | str | None) -> Tenant | None:
        if not key:
            return None
        raw = key.encode() if isinstance(key, str) else key
        return self._by_hash.get(hashlib.sha256(raw).hexdigest())
