"""API key format `fl-<id>-<secret>`: the id finds the row without scanning; only sha256(secret)
is stored, so a leaked database does not leak usable keys."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import NamedTuple

KEY_PREFIX = "fl-"
_ID_HEX_CHARS = 12
_MAX_SECRET_CHARS = 128


class ParsedKey(NamedTuple):
    key_id: str
    secret: str


def new_key() -> tuple[str, str, str]:
    """A fresh (key_id, secret, full key); the full key is shown once and never stored."""
    key_id = secrets.token_hex(_ID_HEX_CHARS // 2)
    secret = secrets.token_urlsafe(32)
    return key_id, secret, f"{KEY_PREFIX}{key_id}-{secret}"


def parse_key(token: str) -> ParsedKey | None:
    """Split a presented key; None if it is not shaped like one of ours."""
    if not token.startswith(KEY_PREFIX):
        return None
    key_id, sep, secret = token[len(KEY_PREFIX):].partition("-")
    if not sep or len(key_id) != _ID_HEX_CHARS or not secret or len(secret) > _MAX_SECRET_CHARS:
        return None
    if any(c not in "0123456789abcdef" for c in key_id):
        return None
    return ParsedKey(key_id, secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of the presented secret's hash with the stored one."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)
