"""Authenticator: `Authorization: Bearer ...` → Principal (tenant, key, tier, limits), or AuthError.

Two kinds of credential: our API keys (`fl-<id>-<secret>`, looked up by id, secret compared by
hash) and JWTs from an identity provider (the tenant is a claim). Either way the tenant must
exist in the store, since that is where its limits live.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ferrylm.gateway.api_keys import KEY_PREFIX, parse_key, secret_matches
from ferrylm.gateway.config import JWTConfig
from ferrylm.gateway.errors import AuthError, PermissionDenied
from ferrylm.gateway.jwt_auth import JWTVerifier
from ferrylm.gateway.store import Store, Tenant

_MAX_HEADER_CHARS = 8192


@dataclass(frozen=True)
class Principal:
    """Who is calling and what they may do; None limits are unlimited."""

    tenant: str
    key_id: str | None
    tier: str
    method: str  # "api_key" | "jwt" | "anonymous"
    models: tuple[str, ...] = ()  # empty: every model
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_tokens: int | None = None
    key_rpm: int | None = None
    key_tpm: int | None = None
    subject: str | None = None  # the JWT's sub


def principal_for(tenant: Tenant, key_id: str | None, method: str, key_rpm: int | None = None,
                  key_tpm: int | None = None, subject: str | None = None) -> Principal:
    return Principal(tenant.name, key_id, tenant.tier, method, tenant.models, tenant.rpm, tenant.tpm,
                     tenant.max_concurrency, tenant.daily_tokens, key_rpm, key_tpm, subject)


def bearer_token(authorization: str | None) -> str:
    """The token of a `Bearer <token>` header, or AuthError."""
    if not authorization:
        raise AuthError("You didn't provide an API key. Provide it as 'Authorization: Bearer YOUR_KEY'.",
                        "missing_api_key")
    if len(authorization) > _MAX_HEADER_CHARS:
        raise AuthError()
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("Expected 'Authorization: Bearer YOUR_KEY'.", "invalid_authorization_header")
    return token


def check_model(principal: Principal, model: str) -> None:
    """PermissionDenied (403) unless the principal's tenant may use `model`."""
    if principal.models and model not in principal.models:
        raise PermissionDenied(f"Tenant '{principal.tenant}' may not use model '{model}'.")


class Authenticator:
    """Resolves credentials against the Store (keys, tenants) and an optional JWTVerifier."""

    def __init__(self, store: Store, jwt_config: JWTConfig | None = None, clock: Callable[[], float] = time.time):
        self._store = store
        self._jwt = JWTVerifier(jwt_config, clock) if jwt_config else None
        self._tenant_claim = jwt_config.tenant_claim if jwt_config else None
        self._clock = clock

    def authenticate(self, authorization: str | None) -> Principal:
        token = bearer_token(authorization)
        if token.startswith(KEY_PREFIX):
            return self._from_api_key(token)
        if self._jwt is not None and token.count(".") == 2:
            return self._from_jwt(token)
        raise AuthError()

    def _from_api_key(self, token: str) -> Principal:
        parsed = parse_key(token)
        found = self._store.lookup_key(parsed.key_id) if parsed else None
        if parsed is None or found is None or not secret_matches(parsed.secret, found[1]):
            raise AuthError()
        key, _, tenant = found
        if key.revoked_at is not None:
            raise AuthError("This API key has been revoked.", "revoked_api_key")
        if key.expires_at is not None and self._clock() >= key.expires_at:
            raise AuthError("This API key has expired.", "expired_api_key")
        return principal_for(tenant, key.key_id, "api_key", key.rpm, key.tpm)

    def _from_jwt(self, token: str) -> Principal:
        assert self._jwt is not None  # authenticate() routes here only with a verifier
        claims = self._jwt.verify(token)
        name = claims.get(self._tenant_claim)
        if not isinstance(name, str) or not name:
            raise AuthError("Token has no tenant.", "invalid_token")
        tenant = self._store.get_tenant(name)
        if tenant is None:
            raise AuthError("Token names an unknown tenant.", "invalid_token")
        sub = claims.get("sub")
        subject = sub if isinstance(sub, str) else None
        key_id = f"jwt:{subject}" if subject else "jwt"
        return principal_for(tenant, key_id[:160], "jwt", subject=subject)
