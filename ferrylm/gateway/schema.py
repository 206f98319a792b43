"""Tables of the gateway's state database, in portable SQLAlchemy Core (SQLite and PostgreSQL).

Times are epoch seconds (float) so both databases compare them the same way.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text

# A declaration, not state: the schema every Store creates and queries.
metadata = MetaData()

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a BIGINT identity.
_AutoId = BigInteger().with_variant(Integer(), "sqlite")

tenants = Table(
    "tenants", metadata,
    Column("name", String(128), primary_key=True),
    Column("tier", String(64), nullable=False),
    Column("rpm", Integer, nullable=True),  # NULL: no limit
    Column("tpm", Integer, nullable=True),
    Column("max_concurrency", Integer, nullable=True),
    Column("daily_tokens", BigInteger, nullable=True),
    Column("models", Text, nullable=True),  # comma-separated; NULL: every model
    Column("created_at", Float, nullable=False),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(32), primary_key=True),
    Column("tenant", String(128), ForeignKey("tenants.name"), nullable=False, index=True),
    Column("secret_sha256", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=True),
    Column("revoked_at", Float, nullable=True),
    Column("rpm", Integer, nullable=True),  # per-key limits on top of the tenant's
    Column("tpm", Integer, nullable=True),
)

daily_usage = Table(
    "daily_usage", metadata,
    Column("tenant", String(128), primary_key=True),
    Column("day", String(10), primary_key=True),  # UTC date, YYYY-MM-DD
    Column("tokens", BigInteger, nullable=False),
)

audit_log = Table(
    "audit_log", metadata,
    Column("id", _AutoId, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("request_id", String(128), nullable=False),
    Column("tenant", String(128), nullable=True),
    Column("key_id", String(160), nullable=True),
    Column("model", String(256), nullable=True),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("status", Integer, nullable=False),
    Column("error_code", String(64), nullable=True),
    Column("latency_s", Float, nullable=False),
    Column("client_addr", String(128), nullable=True),
    Column("prompt", Text, nullable=True),  # only with audit_prompts
    Column("cached_tokens", Integer, nullable=False, server_default="0"),  # added in M3.2 (store.py adds it)
)
Index("ix_audit_log_tenant_ts", audit_log.c.tenant, audit_log.c.ts)
