"""Hypothesis on the auth path: whatever the Authorization header holds, the only outcomes are a
valid principal for a real credential or AuthError (401); never another exception, never an
unauthenticated admission."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ferrylm.gateway import Gateway, GatewayConfig, JWTConfig
from ferrylm.gateway.auth import Authenticator
from ferrylm.gateway.errors import AuthError
from ferrylm.gateway.store import Store
from tests.conftest import examples
from tests.gateway.helpers import T0, FakeClock
from tests.gateway.jwt_helpers import b64url, forge_hs256

SECRET = "fuzz-secret-0123456789abcdef0123456789"
# Derandomized under the ci profile (tests/conftest.py); `make fuzz` scales the examples up.
FUZZ = settings(max_examples=examples(300), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def world(rsa_keys):
    """A store with a tenant and a live key, and an authenticator accepting HS256 and RS256."""
    clock = FakeClock()
    store = Store("sqlite://", clock)
    store.create_tenant("acme")
    _, key = store.create_key("acme")
    config = JWTConfig(secret=SECRET, public_key_pem=rsa_keys[1], algorithms=("HS256", "RS256"),
                       audience="ferrylm")
    gateway = Gateway(GatewayConfig(require_auth=True, state_db="sqlite://", jwt=config), store=store, clock=clock)
    yield Authenticator(store, config, clock), gateway, key, rsa_keys[1]
    store.close()


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=8)
# Valid values are one branch of each, so some drawn claim sets are sound and most are not.
claims = st.fixed_dictionaries(
    {"tenant": st.one_of(st.just("acme"), json_values),
     "exp": st.one_of(st.floats(T0 + 1, T0 + 1e7), st.floats(allow_nan=False), json_values),
     "aud": st.one_of(st.just("ferrylm"), st.just(["x", "ferrylm"]), json_values)},
    optional={"nbf": st.one_of(st.floats(T0 - 1e6, T0 + 1e6), json_values), "sub": json_values,
              "iss": json_values})
headers = st.fixed_dictionaries({"alg": st.one_of(st.sampled_from(["none", "None", "HS256", "RS256", "ES256",
                                                                   "HS512", ""]), json_values)},
                                optional={"typ": json_values, "kid": json_values, "crit": json_values})


@st.composite
def jwt_like(draw, forged_secret: bytes = b"not-our-secret") -> str:
    """Three dot-separated base64url segments: random JSON, random bytes, or HS256 signatures made
    with `forged_secret` (the RS256 public key in the key-confusion case) or random bytes."""
    header, body = draw(headers), draw(claims)
    kind = draw(st.sampled_from(["random", "forged_hs", "wrong_secret", "garbage_segments"]))
    if kind == "garbage_segments":
        return ".".join(draw(st.text(alphabet="abcXYZ019-_=+/.", max_size=40)) for _ in range(3))
    if kind == "random":
        signature = b64url(draw(st.binary(max_size=64)))
        return f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(body).encode())}.{signature}"
    secret = draw(st.binary(min_size=1, max_size=64)) if kind == "wrong_secret" else forged_secret
    return forge_hs256(body, secret, header)


@FUZZ
@given(header=st.one_of(st.none(), st.text(max_size=200), st.text(max_size=200).map(lambda s: "Bearer " + s),
                        st.text(alphabet="0123456789abcdef-", max_size=80).map(lambda s: "Bearer fl-" + s)))
def test_random_headers_only_raise_auth_error(world, header):
    auth = world[0]
    with pytest.raises(AuthError):
        auth.authenticate(header)


@FUZZ
@given(data=st.data())
def test_random_jwts_only_raise_auth_error(world, data):
    auth, _, _, public_pem = world
    token = data.draw(jwt_like(public_pem.encode()))
    with pytest.raises(AuthError):
        auth.authenticate(f"Bearer {token}")


@FUZZ
@given(body=claims, header=headers)
def test_validly_signed_random_claims(world, body, header):
    """Signed with our own secret, so only the claims decide: a principal only for sound claims."""
    auth = world[0]
    token = forge_hs256(body, SECRET.encode(), {**header, "alg": "HS256"})
    try:
        principal = auth.authenticate(f"Bearer {token}")
    except AuthError:
        event("refused")
        return
    event("admitted")
    assert principal.tenant == body["tenant"] == "acme"
    assert body["aud"] == "ferrylm" or (isinstance(body["aud"], list) and "ferrylm" in body["aud"])
    assert not isinstance(body["exp"], bool) and body["exp"] > T0
    assert "nbf" not in body or body["nbf"] <= T0


@settings(FUZZ, max_examples=examples(150))
@given(headers=st.dictionaries(st.sampled_from(["authorization", "Authorization", "AUTHORIZATION", "x-api-key"]),
                               st.one_of(st.text(max_size=100), jwt_like().map(lambda t: "Bearer " + t)), max_size=3))
def test_gateway_never_admits_without_credentials(world, headers):
    _, gateway, _, _ = world
    try:
        gateway.admit_sync(headers, "198.51.100.1", "m", 5, 5, None)
    except AuthError as e:
        assert e.status == 401
    else:
        pytest.fail(f"admitted without a valid credential: {headers!r}")
    gateway.check_invariants()


def test_the_real_key_still_works(world):
    auth, _, key, _ = world
    assert auth.authenticate(f"Bearer {key}").tenant == "acme"
