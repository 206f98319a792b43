"""`ferrylm tenants|keys ...` through gateway.cli.main with argv lists."""

from __future__ import annotations

import argparse

import pytest

from ferrylm.gateway.auth import Authenticator
from ferrylm.gateway.cli import add_gateway_commands, main
from ferrylm.gateway.errors import AuthError
from ferrylm.gateway.store import Store


@pytest.fixture
def db(tmp_path) -> list[str]:
    return ["--state-db", f"sqlite:///{tmp_path / 'cli.db'}"]


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_tenant_and_key_lifecycle(capsys, db):
    code, out, _ = run(capsys, ["tenants", "create", "acme", "--tier", "premium", "--rpm", "60", "--tpm", "1000",
                                "--max-concurrency", "4", "--daily-tokens", "100000", "--models", "a,b", *db])
    assert code == 0 and "acme" in out and "premium" in out
    assert run(capsys, ["tenants", "create", "acme", *db])[0] == 1
    code, out, _ = run(capsys, ["tenants", "list", *db])
    assert "a,b" in out and "100000" in out
    code, out, err = run(capsys, ["keys", "create", "--tenant", "acme", "--expires-in-days", "30", *db])
    key = out.strip().splitlines()[-1]
    assert code == 0 and key.startswith("fl-") and "cannot be shown again" in err
    store = Store(db[1])
    principal = Authenticator(store).authenticate(f"Bearer {key}")
    assert (principal.tenant, principal.tier, principal.models, principal.daily_tokens) == \
        ("acme", "premium", ("a", "b"), 100000)
    code, out, _ = run(capsys, ["keys", "list", *db])
    assert principal.key_id in out and "active" in out and key not in out
    assert run(capsys, ["keys", "revoke", principal.key_id, *db])[0] == 0
    assert run(capsys, ["keys", "revoke", principal.key_id, *db])[0] == 1
    assert "revoked" in run(capsys, ["keys", "list", "--tenant", "acme", *db])[1]
    with pytest.raises(AuthError):
        Authenticator(store).authenticate(f"Bearer {key}")
    store.close()


def test_errors_exit_1(capsys, db):
    code, _, err = run(capsys, ["keys", "create", "--tenant", "ghost", *db])
    assert code == 1 and "no tenant 'ghost'" in err
    assert run(capsys, ["tenants", "create", "t", "--rpm", "0", *db])[0] == 1
    run(capsys, ["tenants", "create", "t", *db])
    assert run(capsys, ["keys", "create", "--tenant", "t", "--expires-in-days", "-1", *db])[0] == 1


def test_registers_on_a_host_parser(db):
    parser = argparse.ArgumentParser(prog="ferrylm")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve")
    add_gateway_commands(sub)
    args = parser.parse_args(["keys", "list", *db])
    assert callable(args.func) and args.state_db == db[1]
