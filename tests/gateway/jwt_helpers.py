"""Token builders for the auth tests, including the forged ones PyJWT refuses to make."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge_hs256(claims: dict, secret: bytes, header: dict | None = None) -> str:
    """An HS256 token signed with any bytes as the HMAC secret (e.g. an RSA public key PEM)."""
    header = header or {"alg": "HS256", "typ": "JWT"}
    signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def unsigned(claims: dict, alg: str = "none") -> str:
    """`alg: none` with an empty signature."""
    header = {"alg": alg, "typ": "JWT"}
    return f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}."
