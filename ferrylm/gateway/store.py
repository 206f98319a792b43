"""Store: tenants, API keys and daily usage in the state database (SQLite by default, any
SQLAlchemy URL works). Rows come back as frozen dataclasses, never live ORM objects."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TypeVar

from sqlalchemy import BigInteger, Connection, bindparam, create_engine, event, insert, inspect, select, text, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool

from ferrylm.gateway.api_keys import hash_secret, new_key
from ferrylm.gateway.schema import api_keys, daily_usage, metadata, tenants

T = TypeVar("T")


class StoreError(ValueError):
    """A user-facing problem with stored state: duplicate tenant, unknown key, bad value."""


@dataclass(frozen=True)
class Tenant:
    """A customer of the gateway and its limits; None means unlimited."""

    name: str
    tier: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_tokens: int | None = None
    models: tuple[str, ...] = ()  # empty: every model
    created_at: float = 0.0


@dataclass(frozen=True)
class ApiKey:
    """A key's stored facts (never its secret)."""

    key_id: str
    tenant: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    rpm: int | None = None
    tpm: int | None = None


def _tenant(row) -> Tenant:
    models = tuple(m for m in (row.models or "").split(",") if m)
    return Tenant(row.name, row.tier, row.rpm, row.tpm, row.max_concurrency, row.daily_tokens, models,
                  row.created_at)


def _key(row) -> ApiKey:
    return ApiKey(row.id, row.tenant, row.created_at, row.expires_at, row.revoked_at, row.rpm, row.tpm)


def _positive_or_none(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise StoreError(f"{name} must be a positive integer (omit it for no limit)")
    return value


class _Statements:
    """The per-request statements, built once with bind parameters (building a SQLAlchemy
    statement costs more than SQLite running it)."""

    def __init__(self) -> None:
        self.lookup_key = (
            select(api_keys.c.id, api_keys.c.tenant, api_keys.c.created_at, api_keys.c.expires_at,
                   api_keys.c.revoked_at, api_keys.c.rpm, api_keys.c.tpm, api_keys.c.secret_sha256,
                   *[c.label(f"t_{c.name}") for c in tenants.c])
            .join(tenants, tenants.c.name == api_keys.c.tenant).where(api_keys.c.id == bindparam("key_id")))
        self.tenant = select(tenants).where(tenants.c.name == bindparam("b_name"))
        # Bind names differ from column names: SQLAlchemy reserves those for VALUES/SET.
        this_day = (daily_usage.c.tenant == bindparam("b_tenant"), daily_usage.c.day == bindparam("b_day"))
        self.usage = select(daily_usage.c.tokens).where(*this_day)
        self.add_usage = update(daily_usage).where(*this_day).values(
            tokens=daily_usage.c.tokens + bindparam("b_tokens", type_=BigInteger))
        self.insert_usage = insert(daily_usage)


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL + a busy timeout so the CLI and servers can share it."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    in_memory = parsed.database in (None, "", ":memory:")
    kwargs = {"poolclass": StaticPool} if in_memory else {}
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:
        cursor = dbapi_conn.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


class Store:
    """The gateway's durable state. Thread-safe (one pooled engine); creates its tables."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time):
        self.url = url
        self.engine = make_engine(url)
        self._clock = clock
        self._statements = _Statements()
        try:
            metadata.create_all(self.engine)
        except (OperationalError, ProgrammingError, IntegrityError):
            metadata.create_all(self.engine)  # another replica created the tables meanwhile
        self._add_new_columns()

    def _add_new_columns(self) -> None:
        """A database made by an older version lacks the columns added since (each has a server
        default): add them, so upgrading keeps every tenant, key and audit row."""
        inspector = inspect(self.engine)
        for table in metadata.sorted_tables:
            have = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in have or column.server_default is None:
                    continue
                kind = column.type.compile(self.engine.dialect)
                default = column.server_default.arg  # type: ignore[attr-defined]
                try:
                    with self.engine.begin() as conn:
                        conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN {column.name} {kind} '
                                          f"NOT NULL DEFAULT {default}"))
                except (OperationalError, ProgrammingError):
                    pass  # another replica added it meanwhile

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    def run_in_transaction(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn` in one transaction, retrying once if a concurrent insert won a race."""
        try:
            with self.engine.begin() as conn:
                return fn(conn)
        except IntegrityError:
            with self.engine.begin() as conn:
                return fn(conn)

    # tenants

    def create_tenant(self, name: str, tier: str = "standard", rpm: int | None = None, tpm: int | None = None,
                      max_concurrency: int | None = None, daily_tokens: int | None = None,
                      models: tuple[str, ...] = ()) -> Tenant:
        if not name or "," in name or len(name) > 128:
            raise StoreError("tenant names are 1-128 characters without commas")
        values = dict(name=name, tier=tier, rpm=_positive_or_none("rpm", rpm), tpm=_positive_or_none("tpm", tpm),
                      max_concurrency=_positive_or_none("max_concurrency", max_concurrency),
                      daily_tokens=_positive_or_none("daily_tokens", daily_tokens),
                      models=",".join(m.strip() for m in models if m.strip()) or None, created_at=self._clock())
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(tenants).values(**values))
        except IntegrityError:
            raise StoreError(f"tenant {name!r} already exists") from None
        created = self.get_tenant(name)
        assert created is not None  # just inserted; tenants are never deleted
        return created

    def get_tenant(self, name: str) -> Tenant | None:
        with self.engine.connect() as conn:
            row = conn.execute(self._statements.tenant, {"b_name": name}).first()
        return _tenant(row) if row else None

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as conn:
            return [_tenant(r) for r in conn.execute(select(tenants).order_by(tenants.c.name))]

    # keys

    def create_key(self, tenant: str, expires_at: float | None = None, rpm: int | None = None,
                   tpm: int | None = None) -> tuple[ApiKey, str]:
        """A new key for `tenant`: (its stored facts, the full key to show once)."""
        if self.get_tenant(tenant) is None:
            raise StoreError(f"no tenant {tenant!r}")
        key_id, secret, full = new_key()
        with self.engine.begin() as conn:
            conn.execute(insert(api_keys).values(
                id=key_id, tenant=tenant, secret_sha256=hash_secret(secret), created_at=self._clock(),
                expires_at=expires_at, rpm=_positive_or_none("rpm", rpm), tpm=_positive_or_none("tpm", tpm)))
        created = self.get_key(key_id)
        assert created is not None  # just inserted
        return created[0], full

    def get_key(self, key_id: str) -> tuple[ApiKey, str] | None:
        """The key's facts and stored secret hash (for Authenticator only)."""
        with self.engine.connect() as conn:
            row = conn.execute(select(api_keys).where(api_keys.c.id == key_id)).first()
        return (_key(row), row.secret_sha256) if row else None

    def lookup_key(self, key_id: str) -> tuple[ApiKey, str, Tenant] | None:
        """Key facts, secret hash and tenant in one query (the per-request auth path)."""
        with self.engine.connect() as conn:
            row = conn.execute(self._statements.lookup_key, {"key_id": key_id}).first()
        if row is None:
            return None
        m = row._mapping
        tenant = _tenant(SimpleNamespace(**{c.name: m[f"t_{c.name}"] for c in tenants.c}))
        return _key(row), row.secret_sha256, tenant

    def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        query = select(api_keys).order_by(api_keys.c.tenant, api_keys.c.created_at)
        if tenant is not None:
            query = query.where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [_key(r) for r in conn.execute(query)]

    def revoke_key(self, key_id: str) -> bool:
        """Revoke now; False if there is no such key or it was already revoked."""
        with self.engine.begin() as conn:
            result = conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                                  .values(revoked_at=self._clock()))
        return result.rowcount == 1

    # daily usage

    def usage(self, tenant: str, day: str) -> int:
        with self.engine.connect() as conn:
            value = conn.execute(self._statements.usage, {"b_tenant": tenant, "b_day": day}).scalar()
        return int(value or 0)

    def add_usage(self, conn: Connection, tenant: str, day: str, tokens: int) -> None:
        """Atomically add tokens to a tenant's day (UPDATE, or INSERT for the day's first charge;
        a concurrent first insert raises IntegrityError, which run_in_transaction retries)."""
        bound = {"b_tenant": tenant, "b_day": day, "b_tokens": tokens}
        if conn.execute(self._statements.add_usage, bound).rowcount == 0:
            conn.execute(self._statements.insert_usage, {"tenant": tenant, "day": day, "tokens": tokens})
