"""`ferrylm tenants ...` and `ferrylm keys ...`: manage the gateway's state database.

`add_gateway_commands(subparsers)` registers the commands on the main parser; each sets
`func(args) -> int`. `main(argv)` runs them on their own (tests, scripts).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ferrylm.gateway.config import DEFAULT_STATE_DB
from ferrylm.gateway.store import ApiKey, Store, StoreError, Tenant

_SECONDS_PER_DAY = 86400.0


def _state_db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-db", default=os.environ.get("FERRYLM_STATE_DB", DEFAULT_STATE_DB),
                   help="SQLAlchemy URL of the gateway state (env FERRYLM_STATE_DB; default %(default)s)")


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[Store]:
    """The Store for one command, closed after it."""
    store = Store(args.state_db)
    try:
        yield store
    finally:
        store.close()


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _when(ts: float | None) -> str:
    return "-" if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)


def _tenant_row(t: Tenant) -> list[str]:
    return [t.name, t.tier, _limit(t.rpm), _limit(t.tpm), _limit(t.max_concurrency), _limit(t.daily_tokens),
            ",".join(t.models) or "*"]


def _key_row(k: ApiKey) -> list[str]:
    status = "active"
    if k.revoked_at is not None:
        status = "revoked"
    elif k.expires_at is not None and k.expires_at <= time.time():
        status = "expired"
    return [k.key_id, k.tenant, status, _when(k.created_at), _when(k.expires_at), _limit(k.rpm), _limit(k.tpm)]


def cmd_tenants_create(args: argparse.Namespace) -> int:
    models = tuple(m for m in (args.models or "").split(",") if m.strip())
    with _store(args) as store:
        tenant = store.create_tenant(args.name, args.tier, args.rpm, args.tpm, args.max_concurrency,
                                     args.daily_tokens, models)
    print(_table(["TENANT", "TIER", "RPM", "TPM", "CONCURRENCY", "DAILY_TOKENS", "MODELS"], [_tenant_row(tenant)]))
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    with _store(args) as store:
        rows = [_tenant_row(t) for t in store.list_tenants()]
    print(_table(["TENANT", "TIER", "RPM", "TPM", "CONCURRENCY", "DAILY_TOKENS", "MODELS"], rows))
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    """Prints the key's facts, then the key itself as the last line (shown only this once)."""
    with _store(args) as store:
        expires = None
        if args.expires_in_days is not None:
            if args.expires_in_days <= 0:
                raise StoreError("--expires-in-days must be positive")
            expires = time.time() + args.expires_in_days * _SECONDS_PER_DAY
        key, full = store.create_key(args.tenant, expires, args.rpm, args.tpm)
    print(f"created key {key.key_id} for tenant {key.tenant} (expires {_when(key.expires_at)})")
    print("store it now; it cannot be shown again:", file=sys.stderr)
    print(full)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    with _store(args) as store:
        rows = [_key_row(k) for k in store.list_keys(args.tenant)]
    print(_table(["KEY_ID", "TENANT", "STATUS", "CREATED", "EXPIRES", "RPM", "TPM"], rows))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    with _store(args) as store:
        if not store.revoke_key(args.key_id):
            raise StoreError(f"no active key {args.key_id!r}")
    print(f"revoked key {args.key_id}")
    return 0


def _handled(fn):
    """Turn StoreError into a message on stderr and exit status 1."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return run


def _add_tenants(sub) -> None:
    tenants = sub.add_parser("tenants", help="manage gateway tenants").add_subparsers(dest="tenants_command",
                                                                                      required=True)
    create = tenants.add_parser("create", help="create a tenant with its limits")
    create.add_argument("name")
    create.add_argument("--tier", default="standard", help="admission tier: premium | standard | batch | ...")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens (prompt + max_tokens) per minute")
    create.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once")
    create.add_argument("--daily-tokens", type=int, default=None, help="tokens per UTC day")
    create.add_argument("--models", default=None, help="comma-separated models it may use (default: all)")
    _state_db_arg(create)
    create.set_defaults(func=_handled(cmd_tenants_create))
    listing = tenants.add_parser("list", help="list tenants")
    _state_db_arg(listing)
    listing.set_defaults(func=_handled(cmd_tenants_list))


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help="manage gateway API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create an API key (printed once, as the last line)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--expires-in-days", type=float, default=None)
    create.add_argument("--rpm", type=int, default=None, help="per-key requests/min on top of the tenant's")
    create.add_argument("--tpm", type=int, default=None, help="per-key tokens/min on top of the tenant's")
    _state_db_arg(create)
    create.set_defaults(func=_handled(cmd_keys_create))
    listing = keys.add_parser("list", help="list API keys (never their secrets)")
    listing.add_argument("--tenant", default=None)
    _state_db_arg(listing)
    listing.set_defaults(func=_handled(cmd_keys_list))
    revoke = keys.add_parser("revoke", help="revoke an API key by id")
    revoke.add_argument("key_id")
    _state_db_arg(revoke)
    revoke.set_defaults(func=_handled(cmd_keys_revoke))


def add_gateway_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `tenants {create,list}` and `keys {create,list,revoke}` on the main CLI."""
    _add_tenants(subparsers)
    _add_keys(subparsers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrylm", description="FerryLM gateway state")
    add_gateway_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
