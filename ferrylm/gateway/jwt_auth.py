"""JWTVerifier: checks a bearer JWT's algorithm, signature, exp/nbf/iss/aud with PyJWT.

The algorithm is chosen from the configured list, never from the token alone: `alg: none` and
algorithms not configured are refused before any key is touched, and each algorithm family has
its own key (HS* the shared secret, RS*/ES*/PS* the public key), so an HS256 token "signed" with
the RSA public key as an HMAC secret cannot verify. exp and nbf are checked against the injected
clock.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from ferrylm.config import ConfigError
from ferrylm.gateway.config import JWTConfig
from ferrylm.gateway.errors import AuthError

_MAX_TOKEN_CHARS = 8192


def _load_jwks(path: str) -> dict[str | None, jwt.PyJWK]:
    """JWKS keys by kid (None: the only key when it has no kid)."""
    try:
        jwks = jwt.PyJWKSet.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, jwt.PyJWTError) as e:
        raise ConfigError(f"cannot load JWKS file {path}: {e}") from None
    keys = {k.key_id: k for k in jwks.keys}
    if len(jwks.keys) == 1 and None not in keys:
        keys[None] = jwks.keys[0]
    return keys


def _timestamp(value: object) -> float:
    """A NumericDate claim as a float, or AuthError: a signed token can still carry a bool, a
    string, inf, or an integer too large for a float (10**400 would overflow every comparison)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AuthError("Invalid token.", "invalid_token")
    try:
        seconds = float(value)
    except OverflowError:
        raise AuthError("Invalid token.", "invalid_token") from None
    if not math.isfinite(seconds):
        raise AuthError("Invalid token.", "invalid_token")
    return seconds


class JWTVerifier:
    """Verifies tokens against one JWTConfig; `verify` returns the claims or raises AuthError."""

    def __init__(self, config: JWTConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self._clock = clock
        self._secret = config.secret.encode() if config.secret else None
        self._public_key = None
        if config.public_key_pem:
            try:
                self._public_key = load_pem_public_key(config.public_key_pem.encode())
            except ValueError as e:
                raise ConfigError(f"cannot load the JWT public key: {e}") from None
        self._jwks = _load_jwks(config.jwks_file) if config.jwks_file else {}

    def verify(self, token: str) -> dict:
        if len(token) > _MAX_TOKEN_CHARS:
            raise AuthError("Invalid token.", "invalid_token")
        try:
            header = jwt.get_unverified_header(token)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise AuthError("Invalid token.", "invalid_token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise AuthError("Token algorithm not accepted.", "invalid_token")
        key = self._key_for(alg, header.get("kid"))
        return self._decode(token, alg, key)

    def _key_for(self, alg: str, kid: object):
        if JWTConfig.is_hmac(alg):
            return self._secret
        if self._public_key is not None:
            return self._public_key
        jwk = self._jwks.get(kid) if isinstance(kid, str) or kid is None else None
        if jwk is None:
            raise AuthError("Token signing key not recognized.", "invalid_token")
        return jwk.key

    def _decode(self, token: str, alg: str, key) -> dict:
        c = self.config
        required = ["exp", c.tenant_claim] + (["iss"] if c.issuer else []) + (["aud"] if c.audience else [])
        # Signature, iss, aud and presence are PyJWT's; the time claims are checked below against
        # the gateway's clock (the same one key expiry and rate limits use).
        options: Any = {"require": required, "verify_signature": True, "verify_exp": False, "verify_nbf": False,
                   "verify_iat": False}
        try:
            claims = jwt.decode(token, key, algorithms=[alg], audience=c.audience, issuer=c.issuer, options=options)
        except (jwt.PyJWTError, ValueError, TypeError, KeyError):
            # InvalidSignature, bad aud/iss, malformed segments, a key that does not fit alg.
            raise AuthError("Invalid token.", "invalid_token") from None
        if not isinstance(claims, dict):
            raise AuthError("Invalid token.", "invalid_token")
        self._check_times(claims)
        return claims

    def _check_times(self, claims: dict) -> None:
        now, leeway = self._clock(), self.config.leeway_s
        times = {name: _timestamp(claims.get(name)) for name in ("exp", "nbf", "iat") if name in claims}
        if now >= times["exp"] + leeway:
            raise AuthError("Token has expired.", "token_expired")
        if "nbf" in times and now + leeway < times["nbf"]:
            raise AuthError("Token is not yet valid.", "invalid_token")
