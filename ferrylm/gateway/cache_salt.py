"""Per-tenant prefix-cache isolation (vLLM's `cache_salt`): the salt a request's KV block hashes
start from. A tenant's requests are salted with its own namespace by default, so another tenant's
cached prompt is never a hit for it (no shared blocks, no timing signal, no export of them); a salt
the tenant sends narrows sharing further inside that namespace and can never reach another's.
`shared_prefix_cache` (a deployment's choice) takes the request's salt as it came, as vLLM does."""

from __future__ import annotations

import json

from ferrylm.gateway.auth import Principal


def effective_cache_salt(principal: Principal | None, requested: str | None, shared: bool) -> str | None:
    """The salt the engine hashes with. Anonymous callers (no tenant) and shared deployments keep
    the requested one (the router, a trusted caller, sends the salt it chose for its tenant)."""
    if shared or principal is None or principal.method == "anonymous":
        return requested
    return json.dumps(["tenant", principal.tenant, requested], separators=(",", ":"))
