"""Routing parts without a network: breaker, retry budget, outstanding-token tickets, policies,
config parsing and SSE parsing; invariants are checked after every operation."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.config import ConfigError
from ferrylm.engine.block_manager import block_hashes
from ferrylm.load_report import LoadReport
from ferrylm.router.breaker import BreakerState, CircuitBreaker
from ferrylm.router.config import GroupConfig, RouterConfig, load_router_config
from ferrylm.router.policies import (
    HashRing,
    LatencyEWMA,
    LeastOutstandingTokens,
    PrefixAffinity,
    RoundRobin,
    RouteContext,
)
from ferrylm.router.registry import ReplicaRegistry
from ferrylm.router.replica import Replica
from ferrylm.router.retry_budget import RetryBudget
from ferrylm.router.sse import _parse
from tests.conftest import examples


def replica(url: str) -> Replica:
    r = Replica(url, "g", CircuitBreaker(3, 5.0))
    r.ready = True
    return r


def test_breaker_ejects_after_consecutive_failures_and_half_open_probe_decides():
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    assert not b.record_failure(0.0) and not b.record_failure(0.1)
    b.record_success()  # a success resets the count
    assert not b.record_failure(1.0) and not b.record_failure(1.1)
    assert b.record_failure(1.2) and b.state is BreakerState.OPEN
    assert not b.allow(3.0) and not b.available(3.0)
    assert b.available(6.3) and b.allow(6.3) and b.state is BreakerState.HALF_OPEN
    assert not b.allow(6.4), "only one half-open probe at a time"
    assert b.record_failure(6.5) and b.state is BreakerState.OPEN and b.ejections == 2  # probe failed
    assert b.allow(12.0)
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allow(12.1)
    b.check_invariants()


def test_retry_budget_limits_retries_to_a_fraction_of_requests():
    budget = RetryBudget(ratio=0.2, reserve=3.0)
    spent = sum(budget.try_spend() for _ in range(10))
    assert spent == 3, "a quiet fleet may still retry a few times"
    for _ in range(100):
        budget.deposit()
        budget.try_spend()
        budget.check_invariants()
    assert 15 <= budget.spent - 3 <= 21  # ~20% of 100 requests
    assert budget.denied > 0


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["begin", "first", "gen", "close"]),
                          st.integers(0, 500)), max_size=60))
@settings(max_examples=examples(150), deadline=None)
def test_outstanding_tokens_follow_tickets(ops):
    r = replica("http://a")
    tickets = {}
    for slot, op, n in ops:
        t = tickets.get(slot)
        if op == "begin" and t is None:
            tickets[slot] = r.begin(n, n // 2 + 1)
        elif t is not None and op == "first":
            t.first_token()
        elif t is not None and op == "gen":
            t.generated(n % 7)
        elif t is not None and op == "close":
            t.close()
            t.close()  # idempotent
            del tickets[slot]
        r.check_invariants()
    for t in tickets.values():
        t.close()
    assert r.outstanding_tokens == 0 and r.in_flight == 0


def test_ticket_moves_from_prefill_to_decode():
    r = replica("http://a")
    t = r.begin(prompt_tokens=300, expected_output=100)
    assert r.outstanding_tokens == 400
    t.first_token()
    assert r.outstanding_tokens == 100
    t.generated(30)
    assert r.outstanding_tokens == 70
    t.generated(500)
    assert r.outstanding_tokens == 0
    t.close()
    assert r.in_flight == 0


def test_round_robin_and_least_outstanding():
    a, b, c = replica("http://a"), replica("http://b"), replica("http://c")
    rr = RoundRobin()
    ctx = RouteContext(10, 10)
    assert [rr.choose([a, b, c], ctx).replica.url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    a.begin(1000, 100)
    b.begin(10, 10)
    assert LeastOutstandingTokens().choose([a, b, c], ctx).replica is c
    c.begin(2000, 0)
    assert LeastOutstandingTokens().choose([a, b, c], ctx).replica is b, "tokens, not request counts, decide"


def test_latency_policy_prefers_fast_replicas():
    a, b = replica("http://a"), replica("http://b")
    a.observe_ttft(0.5)
    b.observe_ttft(0.1)
    assert LatencyEWMA().choose([a, b], RouteContext(1, 1)).replica is b


def test_hash_ring_is_stable_and_moves_few_keys_when_a_replica_leaves():
    urls = [f"http://r{i}" for i in range(4)]
    ring, smaller = HashRing(urls), HashRing(urls[:3])
    keys = range(2000)
    first = {k: ring.walk(k)[0] for k in keys}
    assert first == {k: HashRing(list(reversed(urls))).walk(k)[0] for k in keys}, "order-independent"
    assert {k: smaller.walk(k)[0] for k in keys if first[k] != "http://r3"} == \
        {k: v for k, v in first.items() if v != "http://r3"}, "keys of surviving replicas stay put"
    counts = {u: list(first.values()).count(u) for u in urls}
    assert min(counts.values()) > 2000 / 4 * 0.5, counts


def _ctx(tokens: list[int]) -> RouteContext:
    return RouteContext(len(tokens), 16, tuple(block_hashes(tokens, 16)))


def test_prefix_affinity_sends_shared_prefixes_to_one_replica_and_spills_when_loaded():
    reps = [replica(f"http://r{i}") for i in range(3)]
    policy = PrefixAffinity([r.url for r in reps], credit=1.0, map_size=1000)
    rng = random.Random(0)
    systems = [[rng.randrange(1000) for _ in range(96)] for _ in range(4)]
    homes = {}
    for i in range(40):
        s = i % 4
        tokens = systems[s] + [rng.randrange(1000) for _ in range(rng.randrange(5, 40))]
        choice = policy.choose(reps, _ctx(tokens))
        policy.record(_ctx(tokens), choice.replica)
        homes.setdefault(s, set()).add(choice.replica.url)
        assert choice.reason in ("prefix_hash", "prefix_match")
    assert all(len(v) == 1 for v in homes.values()), homes
    # The deepest remembered block wins even if the ring would say otherwise.
    tokens = systems[0] + [1, 2, 3]
    home = next(iter(homes[0]))
    assert policy.choose(reps, _ctx(tokens)).replica.url == home
    # Overload the home replica: the request spills to the least-loaded one.
    loaded = next(r for r in reps if r.url == home)
    loaded.begin(5000, 0)
    spilled = policy.choose(reps, _ctx(tokens))
    assert spilled.reason == "spill" and spilled.replica is not loaded
    # Without the home replica (ejected), its prefixes move to a surviving one.
    survivors = [r for r in reps if r is not loaded]
    assert policy.choose(survivors, _ctx(tokens)).replica in survivors


def test_prefix_affinity_map_is_bounded():
    reps = [replica("http://a"), replica("http://b")]
    policy = PrefixAffinity([r.url for r in reps], 1.0, map_size=50)
    for i in range(20):
        ctx = _ctx(list(range(i * 1000, i * 1000 + 160)))
        policy.record(ctx, reps[i % 2])
    assert len(policy._owner) == 50


def test_config_from_flags_and_yaml(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("""
poll_interval_s: 0.5
policy: round-robin
models:
  smollm2-135m:
    upstreams: [http://127.0.0.1:8001/, http://127.0.0.1:8002]
    policy: prefix-affinity
    aliases: [fast-model]
    fallback: backup
  backup: [http://127.0.0.1:8003]
""")
    config = load_router_config(path, ["other=http://h:1", "http://h:2"], default_model="m", max_attempts=5)
    assert config.poll_interval_s == 0.5 and config.max_attempts == 5
    names = [g.name for g in config.groups]
    assert names == ["smollm2-135m", "backup", "other", "m"]
    g = config.group("smollm2-135m")
    assert g.upstreams == ("http://127.0.0.1:8001", "http://127.0.0.1:8002") and g.policy == "prefix-affinity"
    assert config.group("backup").policy == "round-robin"
    reg = ReplicaRegistry(config)
    assert reg.resolve("fast-model").name == "smollm2-135m" and reg.resolve("nope") is None
    assert reg.resolve(None).name == "smollm2-135m"
    assert [x.name for x in reg.fallback_chain(reg.resolve("fast-model"))] == ["smollm2-135m", "backup"]


@pytest.mark.parametrize("text, message", [
    ("models: {a: {upstreams: []}}", "no upstreams"),
    ("models: {a: {upstreams: ['ftp://x']}}", "http"),
    ("models: {a: {upstreams: ['http://x'], policy: random}}", "unknown policy"),
    ("models: {a: {upstreams: ['http://x'], fallback: b}}", "fallback"),
    ("models: {a: {upstreams: ['http://x'], aliases: [a]}}", "twice"),
    ("models: {a: {upstreams: ['http://x'], colour: red}}", "unknown keys"),
    ("retries: 3\nmodels: {a: ['http://x']}", "unknown settings"),
    ("[1, 2", "cannot read"),
])
def test_bad_router_configs_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_router_config(path)


def test_no_groups_is_an_error():
    with pytest.raises(ConfigError, match="at least one"):
        RouterConfig(())
    with pytest.raises(ConfigError):
        GroupConfig("a", ("http://x",), policy="fastest")


def test_sse_event_parsing():
    ev = _parse(['data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}'])
    assert ev.tokens == 1 and not ev.done and ev.usage is None and ev.raw.endswith(b"\n\n")
    usage = _parse(['data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}'])
    assert usage.usage == {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0} and usage.tokens == 0
    assert _parse(["data: [DONE]"]).done
    err = _parse(['data: {"error": {"message": "boom", "code": "engine_dead"}}'])
    assert err.error["code"] == "engine_dead"
    assert _parse(["data: not json"]).data is None
    assert _parse(['data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}']).finished


def test_prefix_affinity_spreads_prompts_that_share_only_a_short_template_prefix():
    """Short chats share the chat template's first blocks; following that match would pin every
    one of them to one replica. Load decides once the saving (32 tokens) is smaller than the gap."""
    reps = [replica("http://a"), replica("http://b")]
    policy = PrefixAffinity([r.url for r in reps], 1.0, map_size=1000)
    template = list(range(32))  # two shared blocks
    used = {}
    for i in range(10):
        ctx = _ctx(template + [1000 + i] * 20)
        choice = policy.choose(reps, ctx)
        policy.record(ctx, choice.replica)
        choice.replica.begin(ctx.prompt_tokens, 16)  # each stays in flight
        used[choice.replica.url] = used.get(choice.replica.url, 0) + 1
    assert used == {"http://a": 5, "http://b": 5}, used


def test_standalone_admission_reads_the_fleet_load():
    """The standalone gateway sums its replicas' polled engine stats for admission control: an
    all-down group is shed with 503 at once; a deep fleet queue with 429 + Retry-After."""
    from ferrylm.gateway import GatewayConfig
    from ferrylm.http.errors import APIError
    from ferrylm.router.app import GatewayState
    from ferrylm.router.config import GatewayServerConfig

    router = RouterConfig((GroupConfig("m", ("http://a", "http://b")),))
    state = GatewayState(GatewayServerConfig(router, GatewayConfig(state_db="sqlite://")))
    try:
        group = state.registry.resolve("m")
        down = state.group_load(group)
        assert down is not None and not down.healthy
        with pytest.raises(APIError) as err:
            state.gateway.admit_sync({}, None, "m", 10, 10, down)
        assert err.value.status == 503 and "Retry-After" in err.value.headers
        a, b = group.replicas
        a.ready = b.ready = True
        empty = LoadReport.empty()
        a.load = dataclasses.replace(empty, num_waiting=2, num_running=4, num_waiting_prompt_tokens=100,
                                     kv_blocks_used=50, kv_blocks_total=100, prompt_tokens_total=1000,
                                     generation_tokens_total=500)
        b.load = dataclasses.replace(empty, num_waiting=1, num_running=4, num_waiting_prompt_tokens=50,
                                     kv_blocks_used=90, kv_blocks_total=300, prompt_tokens_total=10,
                                     generation_tokens_total=20, healthy=False)
        load = state.group_load(group)
        assert (load.num_waiting, load.num_running, load.num_waiting_prompt_tokens) == (3, 8, 150)
        assert load.tokens_total == 1530 and load.kv_cache_usage == pytest.approx(140 / 400), "the fleet's blocks"
        assert load.healthy, "the group can serve: its health, not what one replica said at the last poll"
        admitted = state.gateway.admit_sync({}, None, "m", 10, 10, load)
        state.gateway.finish_sync(admitted, 200, 10, 10)
        # A queue the fleet drains at ~100 tok/s with 100k tokens waiting: far over the 10 s budget.
        state.gateway.drain._rate = 100.0
        deep = dataclasses.replace(load, num_waiting=500, num_waiting_prompt_tokens=100_000)
        with pytest.raises(APIError) as err:
            state.gateway.admit_sync({}, None, "m", 10, 10, deep)
        assert err.value.status == 429 and int(err.value.headers["Retry-After"]) >= 1
        state.gateway.check_invariants()
    finally:
        state.gateway.close()


def test_poller_tolerates_slow_probes_but_not_refusals_or_draining():
    """Scripted /ready answers through httpx's MockTransport (the e2e tests use real replicas)."""
    import asyncio

    import httpx

    from ferrylm.router.poller import HealthPoller

    script: list = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            report = dataclasses.replace(LoadReport.empty(), num_waiting=3)
            return httpx.Response(200, json=report.to_json() | {"block_size": 16, "models": ["served-name"]})
        answer = script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer[0], json={"status": answer[1]})

    config = RouterConfig((GroupConfig("m", ("http://a",)),), poll_failures=2)
    registry = ReplicaRegistry(config)
    rep = registry.replicas()[0]

    async def run(answers) -> list[bool]:
        script[:] = answers
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            poller = HealthPoller(registry, config, client)
            seen = []
            for _ in answers:
                await poller.poll_once()
                seen.append(rep.ready)
            return seen

    timeout = httpx.ReadTimeout("slow")
    assert asyncio.run(run([(200, "ok"), timeout, (503, "no token within 5.0s"), (200, "ok")])) == \
        [True, True, False, True]
    assert rep.load.num_waiting == 3 and rep.block_size == 16 and rep.served_model == "served-name"
    assert asyncio.run(run([(200, "ok"), httpx.ConnectError("refused")])) == [True, False]
    assert asyncio.run(run([(200, "ok"), (503, "draining")])) == [True, False]
    assert asyncio.run(run([(503, "loading"), (200, "ok")])) == [False, True]
    # An ejected replica that polls ready after its cool-down is closed again (the half-open probe).
    for _ in range(3):
        rep.breaker.record_failure(0.0)
    assert rep.ejected
    rep.breaker.opened_at = -100.0
    asyncio.run(run([(200, "ok")]))
    assert not rep.ejected and rep.available(0.0)


def test_prefix_affinity_keeps_a_session_on_its_replica():
    """An agent session's turns share no remembered block (the router forgot them, or the prompt was
    rewritten) yet go where its context is, until that replica is more loaded than the whole prompt
    is worth; sessions spread over the ring; another tenant's same session id is another session."""
    reps = [replica(f"http://r{i}") for i in range(3)]
    policy = PrefixAffinity([r.url for r in reps], credit=1.0, map_size=1000)
    rng = random.Random(1)
    homes: dict[str, set[str]] = {}
    for turn in range(5):
        for s in range(12):
            tokens = [rng.randrange(1000) for _ in range(200)]  # nothing shared between turns
            ctx = _ctx(tokens)._replace(session=f"salt\0session-{s}")
            choice = policy.choose(reps, ctx)
            policy.record(ctx, choice.replica)
            homes.setdefault(f"session-{s}", set()).add(choice.replica.url)
            if turn:
                assert choice.reason == "session"
    assert all(len(v) == 1 for v in homes.values()), homes
    assert len({next(iter(v)) for v in homes.values()}) > 1  # sessions spread over the replicas
    home = next(r for r in reps if r.url == next(iter(homes["session-0"])))
    ctx = _ctx(list(range(200)))._replace(session="salt\0session-0")
    assert policy.choose(reps, ctx).replica is home
    home.begin(5000, 0)  # more outstanding work than the 200-token prompt saves
    assert policy.choose(reps, ctx).reason == "spill"
    other_tenant = ctx._replace(session="other-salt\0session-0")
    assert policy.choose(reps, other_tenant).reason != "session"


def test_session_key_is_the_header_or_user_under_the_tenant_salt():
    from ferrylm.router.app import _session

    assert _session("abc", "tenant-a") == "tenant-a\0abc" != _session("abc", "tenant-b")
    assert _session(None, "tenant-a") is None and _session("", None) is None and _session(7, None) is None
    assert len(_session("x" * 10_000, None)) == 257  # bounded
