"""AuditLog: one append-only row per request in the state database. There is no update or
delete here on purpose; prompt text is kept only when the operator asks for it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sqlalchemy import Connection, insert, select

from ferrylm.gateway.schema import audit_log
from ferrylm.gateway.store import Store


@dataclass(frozen=True)
class AuditRecord:
    ts: float  # epoch seconds when the request arrived
    request_id: str
    tenant: str | None
    key_id: str | None
    model: str | None
    prompt_tokens: int
    completion_tokens: int
    status: int
    latency_s: float
    client_addr: str | None
    error_code: str | None = None
    prompt: str | None = None
    cached_tokens: int = 0  # of prompt_tokens, those served from the prefix cache


class AuditLog:
    """Writes AuditRecords; drops prompt text unless `record_prompts`."""

    def __init__(self, store: Store, record_prompts: bool = False):
        self._store = store
        self.record_prompts = record_prompts
        self._insert = insert(audit_log)  # built once; values bind per row

    def append(self, conn: Connection, record: AuditRecord) -> None:
        """Insert inside the caller's transaction (so usage and audit commit together)."""
        values = asdict(record)
        if not self.record_prompts:
            values["prompt"] = None
        values["client_addr"] = (values["client_addr"] or None) and values["client_addr"][:128]
        values["model"] = (values["model"] or None) and values["model"][:256]
        values["request_id"] = values["request_id"][:128]
        conn.execute(self._insert, values)

    def write(self, record: AuditRecord) -> None:
        with self._store.transaction() as conn:
            self.append(conn, record)

    def recent(self, limit: int = 100, tenant: str | None = None) -> list[AuditRecord]:
        """Newest first; for operators and tests."""
        query = select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
        if tenant is not None:
            query = query.where(audit_log.c.tenant == tenant)
        fields = AuditRecord.__dataclass_fields__
        with self._store.engine.connect() as conn:
            return [AuditRecord(**{k: v for k, v in row._mapping.items() if k in fields})
                    for row in conn.execute(query)]
