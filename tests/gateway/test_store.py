"""Store: portable schema (compiles for PostgreSQL too), key lookup, atomic daily usage."""

from __future__ import annotations

import threading

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from ferrylm.gateway.schema import metadata
from ferrylm.gateway.store import Store, StoreError


def test_schema_compiles_for_postgresql_and_sqlite():
    for dialect in (postgresql.dialect(), sqlite.dialect()):
        for table in metadata.sorted_tables:
            ddl = str(CreateTable(table).compile(dialect=dialect))
            assert table.name in ddl
            for index in table.indexes:
                str(CreateIndex(index).compile(dialect=dialect))
    audit_ddl = str(CreateTable(metadata.tables["audit_log"]).compile(dialect=postgresql.dialect()))
    assert "BIGSERIAL" in audit_ddl


def test_lookup_key_joins_the_tenant(store):
    store.create_tenant("acme", tier="batch", rpm=5, models=("a", "b"))
    key, _ = store.create_key("acme", rpm=2)
    found, digest, tenant = store.lookup_key(key.key_id)
    assert found == key and len(digest) == 64
    assert (tenant.name, tenant.tier, tenant.rpm, tenant.models) == ("acme", "batch", 5, ("a", "b"))
    assert store.lookup_key("000000000000") is None


def test_validation(store):
    for bad in [dict(name=""), dict(name="a,b"), dict(name="x", rpm=0), dict(name="y", daily_tokens=-5)]:
        try:
            store.create_tenant(**bad)
        except StoreError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_concurrent_usage_adds_up(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'usage.db'}")
    day = "2025-06-15"

    def charge() -> None:
        for _ in range(25):
            store.run_in_transaction(lambda conn: store.add_usage(conn, "acme", day, 3))

    threads = [threading.Thread(target=charge) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.usage("acme", day) == 4 * 25 * 3
    store.close()
