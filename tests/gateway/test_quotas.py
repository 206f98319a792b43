"""Daily token quota (insufficient_quota) and the per-tenant concurrency cap; gateway-wide
invariants under random admit/finish/advance sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.gateway import Gateway, GatewayConfig
from ferrylm.gateway.quotas import seconds_to_utc_midnight, utc_day
from ferrylm.gateway.store import Store
from ferrylm.http.errors import APIError
from tests.conftest import examples
from tests.gateway.helpers import FakeClock, admit


def test_daily_quota(make_gateway, store, clock):
    store.create_tenant("acme", daily_tokens=1000)
    key = store.create_key("acme")[1]
    gw = make_gateway()
    held = [admit(gw, key, prompt_tokens=10, max_tokens=300) for _ in range(3)]  # 930 held
    with pytest.raises(APIError) as info:
        admit(gw, key, prompt_tokens=10, max_tokens=300)
    err = info.value
    assert (err.status, err.code, err.type) == (429, "insufficient_quota", "insufficient_quota")
    assert int(err.headers["Retry-After"]) == pytest.approx(seconds_to_utc_midnight(clock()), abs=1)
    for a in held:
        gw.finish_sync(a, 200, 10, 90)  # 100 each actually used
    gw.check_invariants()
    assert gw.daily.used_today("acme") == 300
    admit(gw, key, prompt_tokens=10, max_tokens=600)  # 300 used + 610 held <= 1000
    with pytest.raises(APIError):
        admit(gw, key, prompt_tokens=10, max_tokens=90)
    clock.advance(seconds_to_utc_midnight(clock()) + 1)  # a new UTC day
    admit(gw, key, prompt_tokens=10, max_tokens=300)


def test_daily_usage_is_shared_through_the_database(make_gateway, store, clock):
    store.create_tenant("acme", daily_tokens=500)
    key = store.create_key("acme")[1]
    first, second = make_gateway(), make_gateway()
    a = admit(first, key, prompt_tokens=100, max_tokens=300)
    first.finish_sync(a, 200, 100, 300)
    assert store.usage("acme", utc_day(clock())) == 400
    with pytest.raises(APIError) as info:
        admit(second, key, prompt_tokens=50, max_tokens=100)
    assert info.value.code == "insufficient_quota"


def test_concurrency_cap(make_gateway, store):
    store.create_tenant("acme", max_concurrency=2)
    store.create_tenant("other", max_concurrency=1)
    key, other = store.create_key("acme")[1], store.create_key("other")[1]
    gw = make_gateway()
    a, _ = admit(gw, key), admit(gw, key)
    with pytest.raises(APIError) as info:
        admit(gw, key)
    assert (info.value.status, info.value.code) == (429, "concurrency_limit_exceeded")
    assert info.value.headers["Retry-After"] == "1"
    admit(gw, other)  # caps are per tenant
    gw.finish_sync(a, 200, 10, 5)
    gw.finish_sync(a, 200, 10, 5)  # idempotent: released once
    gw.check_invariants()
    admit(gw, key)
    assert gw.concurrency.active("acme") == 2


def test_refused_requests_release_what_they_took(make_gateway, store):
    store.create_tenant("acme", max_concurrency=5, daily_tokens=10_000, tpm=500)
    key = store.create_key("acme")[1]
    gw = make_gateway()
    admit(gw, key, prompt_tokens=0, max_tokens=400)
    with pytest.raises(APIError) as info:  # rate limit refuses after concurrency and quota took theirs
        admit(gw, key, prompt_tokens=0, max_tokens=400)
    assert info.value.code == "rate_limit_exceeded"
    assert gw.concurrency.active("acme") == 1
    gw.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["admit", "finish", "advance"]), st.integers(0, 500)), max_size=40)


@settings(max_examples=examples(60), deadline=None)
@given(ops=ops)
def test_random_admit_finish_sequences_keep_invariants(ops):
    clock = FakeClock()
    store = Store("sqlite://", clock)
    store.create_tenant("acme", rpm=20, tpm=2000, max_concurrency=3, daily_tokens=5000)
    key = store.create_key("acme")[1]
    gw = Gateway(GatewayConfig(require_auth=True, state_db="sqlite://"), store=store, clock=clock)
    open_ = []
    for op, n in ops:
        if op == "admit":
            try:
                open_.append(admit(gw, key, prompt_tokens=n // 5, max_tokens=n))
            except APIError as e:
                assert e.status == 429
        elif op == "finish" and open_:
            a = open_.pop(n % len(open_))
            gw.finish_sync(a, 200, a.prompt_tokens, n % (a.max_tokens + 1))
        elif op == "advance":
            clock.advance(n / 5)
        gw.check_invariants()
        assert gw.in_flight == len(open_) <= 3
    assert gw.daily.used_today("acme") <= 5000
    store.close()
