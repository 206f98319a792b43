"""The gateway in front of the real model: auth (keys, JWT), model permissions, token-aware rate
limits with refunds, audit records. One server for the module (4x overload shedding: tests/faults)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import jwt
import pytest
import sqlalchemy as sa

from tests.e2e.server_process import ServerProcess

SECRET = "e2e-jwt-secret-that-is-long-enough-for-hs256"


def ferrylm(*args: str, db: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ferrylm.cli", *args, "--state-db", db], check=True,
                         capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('gw') / 'state.db'}"
    ferrylm("tenants", "create", "acme", "--tier", "premium", db=db)
    ferrylm("tenants", "create", "tight", "--tpm", "1000", db=db)
    ferrylm("tenants", "create", "other-model", "--models", "some-other-model", db=db)
    ferrylm("tenants", "create", "bulk", "--tier", "batch", db=db)
    keys = {t: ferrylm("keys", "create", "--tenant", t, db=db) for t in ("acme", "tight", "other-model", "bulk")}
    revoked = ferrylm("keys", "create", "--tenant", "acme", db=db)
    ferrylm("keys", "revoke", revoked.split("-")[1], db=db)
    server = ServerProcess("--model", "smollm2-135m", "--require-auth", "--state-db", db, "--jwt-secret", SECRET,
                           "--jwt-audience", "ferrylm", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")
    server.wait_ready()
    yield server, keys, revoked, db
    assert server.stop() == 0


def chat(server, key, max_tokens=8, **extra):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(server.url("/v1/chat/completions"), json=body, headers=headers, timeout=120)


def token(**claims):
    base = {"tenant": "acme", "aud": "ferrylm", "exp": time.time() + 600}
    return jwt.encode({**base, **claims}, SECRET, algorithm="HS256")


def test_credentials_rejected_with_401(gateway_server):
    server, keys, revoked, _ = gateway_server
    bad = [None, "fl-nope-wrong", keys["acme"][:-2] + "xx", revoked, token(exp=time.time() - 10),
           token(aud="someone-else"), jwt.encode({"tenant": "acme", "aud": "ferrylm"}, "wrong", algorithm="HS256"),
           jwt.encode({"tenant": "acme", "aud": "ferrylm"}, None, algorithm="none")]
    for credential in bad:
        r = chat(server, credential)
        assert r.status_code == 401, (credential, r.text)
        assert r.json()["error"]["type"] in ("invalid_request_error", "authentication_error")


def test_model_not_allowed_is_403(gateway_server):
    server, keys, _, _ = gateway_server
    r = chat(server, keys["other-model"])
    assert r.status_code == 403 and r.json()["error"]["message"]


def test_good_key_and_jwt_served_and_audited(gateway_server):
    server, keys, _, db = gateway_server
    r = chat(server, keys["acme"])
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    assert chat(server, token()).status_code == 200
    engine = sa.create_engine(db)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("select * from audit_log where request_id = :r"), {"r": rid}).mappings().all()
    assert len(rows) == 1 and rows[0]["tenant"] == "acme" and rows[0]["status"] == 200
    assert rows[0]["completion_tokens"] == r.json()["usage"]["completion_tokens"]


def test_token_rate_limit_429_then_refund(gateway_server):
    server, keys, _, _ = gateway_server
    headers = {"Authorization": f"Bearer {keys['tight']}"}
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 300,
            "temperature": 0}

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=body, headers=headers)
                                          for _ in range(4)))

    # Four concurrent reservations of prompt + 300 tokens exceed the 1,000 tokens/min bucket.
    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    assert ok and limited, [r.status_code for r in responses]
    assert float(limited[0].headers["retry-after"]) > 0
    assert limited[0].json()["error"]["code"] == "rate_limit_exceeded"  # OpenAI: type "tokens"
    assert int(ok[0].headers["x-ratelimit-limit-tokens"]) == 1000
    # Short answers: settling refunded most of each reservation, so the tenant is admitted again at
    # once, well before the bucket could have refilled (60 s for 1,000 tokens).
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert used < 300 * len(ok)
    again = chat(server, keys["tight"], max_tokens=300)
    assert again.status_code == 200, again.text
    assert int(again.headers["x-ratelimit-remaining-tokens"]) >= 1000 - used - 2 * 330


