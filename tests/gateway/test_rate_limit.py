"""Token-aware rate limits (in-memory storage): reserve prompt + max_tokens, 429 with Retry-After
from the refill time, success after the refill, refunds at settle; invariants under random ops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.gateway.rate_limit import MemoryBucketStorage, RateLimiter, RateScope, format_duration
from ferrylm.http.errors import APIError
from tests.conftest import examples
from tests.gateway.helpers import FakeClock, admit


@pytest.fixture
def acme_key(store):
    store.create_tenant("acme", tpm=1000, rpm=100)
    return store.create_key("acme")[1]


def test_429_when_reservations_exceed_the_bucket_then_refill(make_gateway, acme_key, clock):
    gw = make_gateway()
    admitted = [admit(gw, acme_key, prompt_tokens=10, max_tokens=300) for _ in range(3)]  # 930 of 1000
    assert admitted[-1].response_headers["x-ratelimit-remaining-tokens"] == "70"
    assert admitted[-1].response_headers["x-ratelimit-limit-tokens"] == "1000"
    with pytest.raises(APIError) as info:
        admit(gw, acme_key, prompt_tokens=10, max_tokens=300)
    err = info.value
    assert err.status == 429 and err.code == "rate_limit_exceeded" and err.type == "tokens"
    # 240 tokens short at 1000/60 tokens/s: 14.4 s.
    assert err.headers["Retry-After"] == "15" and err.headers["retry-after-ms"] == "14400"
    assert err.headers["x-ratelimit-remaining-tokens"] == "70"
    assert err.headers["x-ratelimit-reset-tokens"] == "55.8s"
    clock.advance(14.3)
    with pytest.raises(APIError):
        admit(gw, acme_key, prompt_tokens=10, max_tokens=300)
    clock.advance(0.1)
    admit(gw, acme_key, prompt_tokens=10, max_tokens=300)


def test_unused_reservation_is_refunded(make_gateway, acme_key):
    gw = make_gateway()
    first = [admit(gw, acme_key, prompt_tokens=10, max_tokens=300) for _ in range(3)]
    with pytest.raises(APIError):
        admit(gw, acme_key, prompt_tokens=10, max_tokens=300)
    gw.finish_sync(first[0], 200, prompt_tokens=10, completion_tokens=20)  # used 30 of 310: 280 back
    gw.check_invariants()
    again = admit(gw, acme_key, prompt_tokens=10, max_tokens=300)
    assert again.response_headers["x-ratelimit-remaining-tokens"] == str(1000 - 930 + 280 - 310)


def test_requests_per_minute(make_gateway, store, clock):
    store.create_tenant("slow", rpm=2)
    key = store.create_key("slow")[1]
    gw = make_gateway()
    admit(gw, key)
    admit(gw, key)
    with pytest.raises(APIError) as info:
        admit(gw, key)
    assert info.value.type == "requests" and info.value.headers["Retry-After"] == "30"
    assert info.value.headers["x-ratelimit-limit-requests"] == "2"
    clock.advance(30)
    admit(gw, key)


def test_request_larger_than_the_bucket_never_fits(make_gateway, acme_key):
    gw = make_gateway()
    with pytest.raises(APIError) as info:
        admit(gw, acme_key, prompt_tokens=100, max_tokens=2000)
    assert info.value.status == 429 and "Retry-After" not in info.value.headers
    assert "Reduce max_tokens" in info.value.message


def test_per_key_limits_under_the_tenant(make_gateway, store):
    store.create_tenant("team", tpm=1000)
    narrow = store.create_key("team", tpm=400)[1]
    wide = store.create_key("team")[1]
    gw = make_gateway()
    a = admit(gw, narrow, prompt_tokens=0, max_tokens=300)
    assert a.response_headers["x-ratelimit-remaining-tokens"] == "100"  # the key's bucket binds
    with pytest.raises(APIError):
        admit(gw, narrow, prompt_tokens=0, max_tokens=300)
    admit(gw, wide, prompt_tokens=0, max_tokens=600)  # tenant: 300 + 600 of 1000
    with pytest.raises(APIError):
        admit(gw, wide, prompt_tokens=0, max_tokens=200)


def test_failed_reservation_takes_nothing():
    clock = FakeClock()
    limiter = RateLimiter(MemoryBucketStorage(clock))
    scopes = [RateScope("t", rpm=10, tpm=100)]
    assert limiter.reserve(scopes, 60).allowed
    refused = limiter.reserve(scopes, 60)
    assert not refused.allowed and refused.limited_by == "tokens"
    assert refused.requests.remaining == 9  # the request bucket was not charged for the refusal
    assert limiter.reserve(scopes, 40).allowed


def test_overrun_is_charged():
    clock = FakeClock()
    limiter = RateLimiter(MemoryBucketStorage(clock))
    scopes = [RateScope("t", rpm=None, tpm=100)]
    r = limiter.reserve(scopes, 50)
    limiter.settle(r.reservation, 80)  # used more than reserved (e.g. a longer prompt than estimated)
    assert limiter.reserve(scopes, 21).retry_after_s == pytest.approx(1 / (100 / 60))
    limiter.check_invariants()


def test_unlimited_scopes_always_pass():
    limiter = RateLimiter(MemoryBucketStorage(FakeClock()))
    result = limiter.reserve([RateScope("anon", None, None)], 10**9)
    assert result.allowed and result.headers() == {}


def test_duration_format():
    assert [format_duration(s) for s in (0.02, 1.5, 60, 360, 3723)] == ["20ms", "1.5s", "1m0s", "6m0s", "1h2m3s"]


ops = st.lists(st.tuples(st.sampled_from(["reserve", "settle", "advance"]), st.integers(0, 400),
                         st.floats(0, 1)), max_size=60)


@settings(max_examples=examples(150), deadline=None)
@given(ops=ops, tpm=st.integers(50, 2000), rpm=st.one_of(st.none(), st.integers(1, 50)))
def test_random_operations_never_overspend(ops, tpm, rpm):
    """Net tokens spent never exceed the bucket plus what it refilled; invariants hold throughout."""
    clock = FakeClock()
    limiter = RateLimiter(MemoryBucketStorage(clock))
    scopes = [RateScope("t", rpm, tpm)]
    open_reservations, spent, start = [], 0.0, clock.now
    for op, n, fraction in ops:
        if op == "reserve":
            result = limiter.reserve(scopes, n)
            if result.allowed:
                open_reservations.append(result.reservation)
                spent += n
            else:
                assert result.too_large or result.retry_after_s > 0
        elif op == "settle" and open_reservations:
            reservation = open_reservations.pop(0)
            actual = int(reservation.tokens * fraction)
            limiter.settle(reservation, actual)
            spent -= reservation.tokens - actual
        elif op == "advance":
            clock.advance(n / 10)
        limiter.check_invariants()
        assert spent <= tpm + (clock.now - start) * tpm / 60 + 1e-6
