"""Authenticator: API keys (hashed, revocable, expiring) and JWTs (algorithms pinned, claims
checked), and the per-tenant model allow-list."""

from __future__ import annotations

import json

import jwt
import pytest
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from ferrylm.config import ConfigError
from ferrylm.gateway.api_keys import hash_secret, parse_key
from ferrylm.gateway.auth import Authenticator, check_model
from ferrylm.gateway.config import JWTConfig
from ferrylm.gateway.errors import AuthError, PermissionDenied
from ferrylm.gateway.schema import api_keys
from tests.gateway.helpers import T0
from tests.gateway.jwt_helpers import forge_hs256, unsigned

SECRET = "s3cret-for-tests-only-0123456789abcdef"


def claims(**overrides) -> dict:
    base = {"tenant": "acme", "sub": "alice", "exp": T0 + 3600, "iss": "https://idp.test", "aud": "ferrylm"}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def jwt_config(**overrides) -> JWTConfig:
    return JWTConfig(**{"issuer": "https://idp.test", "audience": "ferrylm", **overrides})


@pytest.fixture
def acme(store):
    store.create_tenant("acme", "premium", models=("small", "large"))
    return store


@pytest.fixture
def auth(acme, clock):
    return Authenticator(acme, None, clock)


def expect_401(auth: Authenticator, header: str | None, code: str | None = None) -> AuthError:
    with pytest.raises(AuthError) as info:
        auth.authenticate(header)
    assert info.value.status == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
    if code:
        assert info.value.code == code
    return info.value


# API keys


def test_good_key_gives_the_tenant(auth, acme):
    key, full = acme.create_key("acme")
    p = auth.authenticate(f"Bearer {full}")
    assert (p.tenant, p.key_id, p.tier, p.method) == ("acme", key.key_id, "premium", "api_key")
    assert auth.authenticate(f"bearer   {full}  ").tenant == "acme"  # scheme is case-insensitive


def test_only_the_hash_is_stored(acme):
    key, full = acme.create_key("acme")
    with acme.engine.connect() as conn:
        row = conn.execute(api_keys.select()).first()
    assert full not in json.dumps([str(v) for v in row])
    assert row.secret_sha256 == hash_secret(parse_key(full).secret)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "Token abc"])
def test_missing_or_malformed_header(auth, header):
    expect_401(auth, header)


def test_wrong_keys(auth, acme):
    _, full = acme.create_key("acme")
    key_id, secret = parse_key(full)
    for bad in [f"fl-{key_id}-{secret}x", f"fl-{key_id}-", "fl-000000000000-" + secret, "fl-nothex-abc",
                "sk-" + secret, full[:-1], "eyJhbGciOiJIUzI1NiJ9.e30.abc"]:
        expect_401(auth, f"Bearer {bad}", "invalid_api_key")


def test_revoked_key(auth, acme):
    key, full = acme.create_key("acme")
    assert auth.authenticate(f"Bearer {full}").tenant == "acme"
    assert acme.revoke_key(key.key_id) and not acme.revoke_key(key.key_id)
    expect_401(auth, f"Bearer {full}", "revoked_api_key")


def test_expired_key(auth, acme, clock):
    _, full = acme.create_key("acme", expires_at=T0 + 10)
    assert auth.authenticate(f"Bearer {full}").tenant == "acme"
    clock.advance(10)
    expect_401(auth, f"Bearer {full}", "expired_api_key")


def test_model_allow_list(auth, acme, store):
    _, full = acme.create_key("acme")
    p = auth.authenticate(f"Bearer {full}")
    check_model(p, "small")
    with pytest.raises(PermissionDenied) as info:
        check_model(p, "huge")
    assert info.value.status == 403 and info.value.body()["error"]["code"] == "model_not_allowed"
    store.create_tenant("open")  # no list: any model
    _, open_key = store.create_key("open")
    check_model(auth.authenticate(f"Bearer {open_key}"), "anything")


# JWT


def test_hs256_jwt(acme, clock):
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    p = auth.authenticate("Bearer " + jwt.encode(claims(), SECRET, algorithm="HS256"))
    assert (p.tenant, p.key_id, p.method, p.subject, p.tier) == ("acme", "jwt:alice", "jwt", "alice", "premium")


def test_expired_jwt(acme, clock):
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    token = jwt.encode(claims(exp=T0 + 60), SECRET, algorithm="HS256")
    assert auth.authenticate(f"Bearer {token}").tenant == "acme"
    clock.advance(60)
    expect_401(auth, f"Bearer {token}", "token_expired")
    expect_401(auth, "Bearer " + jwt.encode(claims(exp=None), SECRET, algorithm="HS256"), "invalid_token")
    expect_401(auth, "Bearer " + jwt.encode(claims(exp="never"), SECRET, algorithm="HS256"), "invalid_token")
    leeway = Authenticator(acme, jwt_config(secret=SECRET, leeway_s=30), clock)
    assert leeway.authenticate(f"Bearer {token}").tenant == "acme"


def test_nbf_in_the_future(acme, clock):
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    token = jwt.encode(claims(nbf=T0 + 100), SECRET, algorithm="HS256")
    expect_401(auth, f"Bearer {token}", "invalid_token")
    clock.advance(100)
    assert auth.authenticate(f"Bearer {token}").tenant == "acme"


@pytest.mark.parametrize("times", [{"exp": 10**400}, {"exp": -10**400}, {"nbf": 10**400}, {"iat": 10**400},
                                   {"exp": 1e400}, {"nbf": -1e400}, {"exp": True}])
def test_validly_signed_absurd_times_are_401_not_a_crash(acme, clock, times):
    """json decodes 10**400 to an int no float can hold; comparing it with the clock overflowed."""
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    token = jwt.encode(claims(**times), SECRET, algorithm="HS256")  # 1e400 is inf: sent as `Infinity`
    expect_401(auth, f"Bearer {token}", "invalid_token")


def test_bad_signature(acme, clock):
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    expect_401(auth, "Bearer " + jwt.encode(claims(), "another-secret-of-32-bytes-len!!", algorithm="HS256"))
    good = jwt.encode(claims(), SECRET, algorithm="HS256")
    head, body, sig = good.split(".")
    tampered = jwt.encode(claims(tenant="other"), SECRET, algorithm="HS256").split(".")[1]
    expect_401(auth, f"Bearer {head}.{tampered}.{sig}")


@pytest.mark.parametrize("field,value", [("aud", "someone-else"), ("iss", "https://evil.test"), ("aud", None),
                                         ("iss", None), ("tenant", None), ("tenant", "ghost"), ("tenant", 7)])
def test_wrong_claims(acme, clock, field, value):
    auth = Authenticator(acme, jwt_config(secret=SECRET), clock)
    expect_401(auth, "Bearer " + jwt.encode(claims(**{field: value}), SECRET, algorithm="HS256"))


def test_alg_none_is_rejected(acme, clock, rsa_keys):
    for config in [jwt_config(secret=SECRET), jwt_config(public_key_pem=rsa_keys[1])]:
        auth = Authenticator(acme, config, clock)
        for alg in ["none", "None", "NONE"]:
            expect_401(auth, f"Bearer {unsigned(claims(), alg)}", "invalid_token")
    with pytest.raises(ConfigError):
        JWTConfig(secret=SECRET, algorithms=("none",))


def test_rs256_and_key_confusion(acme, clock, rsa_keys):
    private, public = rsa_keys
    auth = Authenticator(acme, jwt_config(public_key_pem=public), clock)
    assert auth.authenticate("Bearer " + jwt.encode(claims(), private, algorithm="RS256")).tenant == "acme"
    # The classic attack: HS256 "signed" with the public key as the HMAC secret.
    forged = forge_hs256(claims(), public.encode())
    expect_401(auth, f"Bearer {forged}", "invalid_token")
    # Still refused when HS256 is also configured: HS256 only ever uses the shared secret.
    both = Authenticator(acme, jwt_config(secret=SECRET, public_key_pem=public, algorithms=("HS256", "RS256")), clock)
    expect_401(both, f"Bearer {forged}", "invalid_token")
    assert both.authenticate("Bearer " + jwt.encode(claims(), SECRET, algorithm="HS256")).tenant == "acme"


def test_es256_and_algorithm_pinning(acme, clock, ec_keys, rsa_keys):
    auth = Authenticator(acme, jwt_config(public_key_pem=ec_keys[1], algorithms=("ES256",)), clock)
    assert auth.authenticate("Bearer " + jwt.encode(claims(), ec_keys[0], algorithm="ES256")).tenant == "acme"
    expect_401(auth, "Bearer " + jwt.encode(claims(), rsa_keys[0], algorithm="RS256"))  # not configured
    expect_401(auth, "Bearer " + jwt.encode(claims(), SECRET, algorithm="HS256"))


def test_jwks_file(acme, clock, rsa_keys, tmp_path):
    private, public = rsa_keys
    jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(load_pem_public_key(public.encode())))
    jwk.update(kid="k1", alg="RS256", use="sig")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [jwk]}))
    auth = Authenticator(acme, jwt_config(jwks_file=str(path)), clock)
    token = jwt.encode(claims(), private, algorithm="RS256", headers={"kid": "k1"})
    assert auth.authenticate(f"Bearer {token}").tenant == "acme"
    expect_401(auth, "Bearer " + jwt.encode(claims(), private, algorithm="RS256", headers={"kid": "k2"}))
    expect_401(auth, "Bearer " + forge_hs256(claims(), public.encode(), {"alg": "HS256", "kid": "k1"}))


def test_jwt_config_validation(rsa_keys):
    with pytest.raises(ConfigError):
        JWTConfig()
    with pytest.raises(ConfigError):
        JWTConfig(public_key_pem=rsa_keys[1], algorithms=("HS256",))  # HS256 needs a secret
    with pytest.raises(ConfigError):
        JWTConfig(secret=SECRET, algorithms=("RS256",))  # RS256 needs a public key
    assert JWTConfig(secret=SECRET).algorithms == ("HS256",)
    assert JWTConfig(public_key_pem=rsa_keys[1]).algorithms == ("RS256", "ES256")
