"""Who may read the operational endpoints (/metrics, /load) under `--metrics-require-auth`.

They are open by default, as vLLM's /metrics is, so a Prometheus scrape needs no credential; but
they tell a stranger the fleet's load and, on `ferrylm gateway`, the internal replica URLs (the
`replica` label). With the flag they take the credential /v1 takes: the static `--api-key`, and/or
an API key or JWT the gateway's authenticator verifies. Unlike /v1 on an open server, an
anonymous caller is never enough here: the flag asks for a credential, so one must be shown."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ferrylm.config import ConfigError
from ferrylm.gateway.auth import bearer_token
from ferrylm.gateway.errors import AuthError

if TYPE_CHECKING:
    from ferrylm.gateway.policy import Gateway


def check_credential_sources(require: bool, api_key: str | None, has_gateway: bool) -> None:
    """ConfigError if `require` could never be met: no static key and no gateway to check with."""
    if require and api_key is None and not has_gateway:
        raise ConfigError("--metrics-require-auth needs a credential to check: --api-key, or the gateway "
                          "(not --no-gateway)")


async def require_credential(headers: Mapping[str, str], api_key: str | None, gateway: Gateway | None) -> None:
    """AuthError (401) unless the caller shows what /v1 would accept, anonymous callers excluded."""
    authorization = headers.get("authorization")
    if api_key is not None:
        token = bearer_token(authorization)
        if not secrets.compare_digest(token.encode(), api_key.encode()):
            raise AuthError()
        if gateway is None or not gateway.config.require_auth:
            return  # /v1 takes the static key alone here too
    if gateway is None:
        raise AuthError()
    await asyncio.to_thread(gateway.authenticator.authenticate, authorization)
