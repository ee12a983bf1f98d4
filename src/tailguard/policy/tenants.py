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

import hashlib
import math
import secrets
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

KEY_PREFIX = "tg-"


def hash_key(key: str) -> str:
    """The stored form of an API key: SHA-256 of the key (keys are random 256-bit strings, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


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
    def load(cls, path: str | Path) -> KeyFile:
        p = Path(path)
        if not p.exists():
            return cls()
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a key file is a mapping with 'tenants' and 'keys'")
        kf = cls.model_validate(data)
        for entry in kf.keys:
            if entry.tenant not in kf.tenants:
                raise ValueError(f"{path}: key {entry.sha256[:8]}... names tenant {entry.tenant!r}, which is not "
                                 f"declared under 'tenants'")
        return kf

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o600)
        tmp.replace(p)

    def add_key(self, tenant: str, lane: str | None = None, **limits: Any) -> str:
        """Create a key for ``tenant`` (declaring the tenant if new); returns the key, which is stored only hashed."""
        if tenant not in self.tenants:
            self.tenants[tenant] = TenantConfig(lane=lane or "standard", **limits)
        elif lane is not None or limits:
            cur = self.tenants[tenant].model_dump()
            cur.update({k: v for k, v in limits.items() if v is not None})
            if lane is not None:
                cur["lane"] = lane
            self.tenants[tenant] = TenantConfig(**cur)
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
    def load(cls, path: str | Path | None) -> Tenants:
        return cls(KeyFile.load(path) if path else KeyFile())

    def __bool__(self) -> bool:
        return bool(self._by_hash)

    def lookup(self, key: bytes | str | None) -> Tenant | None:
        if not key:
            return None
        raw = key.encode() if isinstance(key, str) else key
        return self._by_hash.get(hashlib.sha256(raw).hexdigest())
