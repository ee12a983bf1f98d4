"""Who is calling: a client (holder of the API key) or an admin (holder of the admin key).

Client keys reach the inference API and their own request records; the admin key reaches every record, the SLO
alerts and the SLO data. With no admin key configured the admin surfaces are closed to everyone. Records remember
which client key made them by a hash (``key_id``), never the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import SecretStr

from tailguard.api_error import APIError

if TYPE_CHECKING:
    from tailguard.policy.tenants import Tenant, Tenants

_BEARER = "bearer"


def key_id(key: str) -> str:
    """A stable, non-reversible id of a client key (what a record keeps to know its owner)."""
    return hashlib.sha256(b"tailguard-client-key\0" + key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caller:
    admin: bool = False
    key_id: str | None = None  # the client key that authenticated, hashed; None on a server without client keys
    tenant: Tenant | None = None  # the tenant of a key from the key file (its lane and rate limits)


def _bearer(header: str | None) -> bytes | None:
    # The scheme is case-insensitive (RFC 7235 section 2.1): "bearer KEY" and "BEARER KEY" are "Bearer KEY".
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != _BEARER:
        return None
    token = token.strip()
    try:
        return token.encode() if token else None
    except UnicodeEncodeError:  # a lone surrogate cannot be anybody's key
        return None


class Keys:
    def __init__(self, client_keys: list[SecretStr], admin_key: SecretStr | None, tenants: Tenants | None = None) -> None:
        # Each client key with its id, compared in constant time one by one (a handful of keys, not a user table).
        self._clients = [(k.get_secret_value().encode(), key_id(k.get_secret_value())) for k in client_keys]
        self._admin = admin_key.get_secret_value().encode() if admin_key is not None else None
        # Keys of the key file: looked up by their SHA-256 (a table of any size; the file keeps only hashes). A key
        # file configured turns authentication on even when its table is empty (then no key gets in): only None,
        # no key file at all, leaves it off.
        self.tenants = tenants

    def _is_admin(self, token: bytes | None) -> bool:
        return self._admin is not None and token is not None and hmac.compare_digest(token, self._admin)

    def _tenant(self, token: bytes | None) -> Tenant | None:
        return self.tenants.lookup(token) if self.tenants is not None and token else None

    def _client_id(self, token: bytes | None) -> str | None:
        if token is None:
            return None
        if self._tenant(token) is not None:
            return key_id(token.decode())
        found = None
        for key, kid in self._clients:
            if hmac.compare_digest(token, key):
                found = kid
        return found

    def client(self, header: str | None) -> Caller:
        """The inference API: a client key (or the admin key); anyone when no client key is set."""
        token = _bearer(header)
        if self._is_admin(token):
            return Caller(admin=True)
        tenant = self._tenant(token)
        if tenant is not None:
            assert token is not None
            return Caller(key_id=key_id(token.decode()), tenant=tenant)
        if not self._clients and self.tenants is None:
            return Caller()
        kid = self._client_id(token)
        if kid is None:
            raise _unauthorized()
        return Caller(key_id=kid)

    def admin(self, header: str | None) -> Caller:
        """An admin surface: only the admin key."""
        token = _bearer(header)
        if self._is_admin(token):
            return Caller(admin=True)
        if self._admin is None:
            raise APIError(403, "this is an admin surface and no admin key is set: start the server with "
                                "--admin-key (or TAILGUARD_ADMIN_KEY) and send 'Authorization: Bearer <admin key>'",
                           code="admin_key_not_configured")
        if self._client_id(token) is not None:
            raise APIError(403, "this is an admin surface: a client key cannot read it", code="admin_only")
        raise _unauthorized("admin ")

    def owner(self, header: str | None) -> Caller:
        """Request records: the admin key reads all; a client key reads the records it made; nobody else any."""
        token = _bearer(header)
        if self._is_admin(token):
            return Caller(admin=True)
        kid = self._client_id(token)
        if kid is not None:
            return Caller(key_id=kid)
        if self._admin is None and not self._clients and self.tenants is None:
            raise APIError(403, "request records are closed: no admin key or API key is set (start the server "
                                "with --admin-key to read records)", code="admin_key_not_configured")
        raise _unauthorized()


def _unauthorized(kind: str = "") -> APIError:
    return APIError(401, f"invalid or missing {kind}API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key")
