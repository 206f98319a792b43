"""Rate limits in a real redis-server: the same semantics as in memory, and one limit enforced
jointly by gateway replicas in separate processes (not limit x replicas)."""

from __future__ import annotations

import multiprocessing as mp
import uuid

import pytest

from ferrylm.gateway.rate_limit import RateLimiter, RateScope
from ferrylm.http.errors import APIError
from tests.gateway.helpers import FakeClock, admit
from tests.gateway.redis_workers import admit_many

pytest.importorskip("redis")


@pytest.fixture
def storage(redis_url):
    from ferrylm.gateway.rate_limit_redis import RedisBucketStorage

    clock = FakeClock()
    s = RedisBucketStorage.from_url(redis_url, f"test:{uuid.uuid4().hex}:", clock)
    s.clock = clock
    yield s
    s.close()


def test_reserve_refill_refund(storage):
    limiter, clock = RateLimiter(storage), storage.clock
    scopes = [RateScope("acme", rpm=100, tpm=1000)]
    held = [limiter.reserve(scopes, 310) for _ in range(3)]
    assert all(r.allowed for r in held) and held[-1].tokens.remaining == 70
    refused = limiter.reserve(scopes, 310)
    assert not refused.allowed and refused.retry_after_s == pytest.approx(14.4)
    assert refused.requests.remaining == 97  # the refusal took nothing
    clock.advance(14.4)
    assert limiter.reserve(scopes, 310).allowed
    limiter.settle(held[0].reservation, 30)  # 280 back
    again = limiter.reserve(scopes, 280)
    assert again.allowed and again.tokens.remaining == 0
    limiter.check_invariants()


def test_server_clock_when_none_injected(redis_url):
    from ferrylm.gateway.rate_limit_redis import RedisBucketStorage

    storage = RedisBucketStorage.from_url(redis_url, f"test:{uuid.uuid4().hex}:")
    limiter = RateLimiter(storage)
    scopes = [RateScope("t", rpm=None, tpm=60)]
    assert limiter.reserve(scopes, 60).allowed
    refused = limiter.reserve(scopes, 30)
    assert not refused.allowed and 25 < refused.retry_after_s <= 30  # 1 token/s from Redis TIME
    storage.check_invariants()
    storage.close()


def test_gateway_with_redis_limits(make_gateway, store, redis_url):
    store.create_tenant("acme", tpm=1000)
    key = store.create_key("acme")[1]
    gw = make_gateway(redis_url=redis_url, redis_key_prefix=f"test:{uuid.uuid4().hex}:")
    for _ in range(3):
        admit(gw, key, prompt_tokens=10, max_tokens=300)
    with pytest.raises(APIError) as info:
        admit(gw, key, prompt_tokens=10, max_tokens=300)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "15"


def test_two_gateway_processes_share_one_limit(store, redis_url):
    """Each replica alone would admit 16 requests of 60 tokens from a 1000-token bucket; together
    they must still admit 16, not 32."""
    store.create_tenant("acme", tpm=1000)
    key = store.create_key("acme")[1]
    prefix = f"test:{uuid.uuid4().hex}:"
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=admit_many, args=(store.url, redis_url, prefix, key, 30, barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    admitted = sum(n for n, _ in outcomes)
    assert admitted * 60 <= 1000 and admitted == 1000 // 60
    # Without the shared bucket the second replica would admit another 16, whatever the split.
    assert {s for _, statuses in outcomes for s in statuses} == {429}


@pytest.mark.parametrize("mode", ["closed", "open"])
def test_unreachable_redis_follows_the_failure_mode(make_gateway, store, mode):
    """Nothing listens on the Redis port: closed answers 503 + Retry-After, open admits unmetered;
    neither is a 500, and the failures are counted."""
    from tests.e2e.server_process import free_port

    store.create_tenant("acme", rpm=100, tpm=1000)
    key = store.create_key("acme")[1]
    gw = make_gateway(redis_url=f"redis://127.0.0.1:{free_port()}/0", rate_limit_failure_mode=mode)
    if mode == "closed":
        with pytest.raises(APIError) as info:
            gw.admit_sync({"authorization": f"Bearer {key}"}, "127.0.0.1", "m", 10, 100, None)
        assert info.value.status == 503 and info.value.code == "rate_limiter_unavailable"
        assert info.value.headers["Retry-After"] == "1"
    else:
        admission = gw.admit_sync({"authorization": f"Bearer {key}"}, "127.0.0.1", "m", 10, 100, None)
        assert admission.reservation is None  # nothing to settle against the store that is down
        gw.finish_sync(admission, 200, 10, 5)
    assert gw.limiter_failures >= 1


def test_failure_mode_is_checked():
    from ferrylm.gateway.config import ConfigError, GatewayConfig

    with pytest.raises(ConfigError, match="rate_limit_failure_mode"):
        GatewayConfig(rate_limit_failure_mode="sometimes")
