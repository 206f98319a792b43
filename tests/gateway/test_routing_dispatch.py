"""The dispatcher and relay against scripted replicas (httpx.MockTransport): retries before the
first token, the half-open probe slot, echo chunks, early ends, and that tickets always close.
The e2e tests run the same code against real `ferrylm serve` replicas."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from ferrylm.http.errors import APIError
from ferrylm.load_report import LoadReport
from ferrylm.router.config import GroupConfig, RouterConfig
from ferrylm.router.dispatch import Dispatcher
from ferrylm.router.metrics import RouterMetrics
from ferrylm.router.policies import RouteContext
from ferrylm.router.poller import HealthPoller
from ferrylm.router.registry import ReplicaRegistry
from ferrylm.router.relay import StreamRelay


def sse(*payloads) -> bytes:
    out = b""
    for p in payloads:
        out += b"data: " + (p.encode() if isinstance(p, str) else json.dumps(p).encode()) + b"\n\n"
    return out


ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
STOP = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
GOOD = sse(ROLE, TOKEN, STOP, USAGE, "[DONE]")


def world(handler, urls=("http://a", "http://b"), **config):
    cfg = RouterConfig((GroupConfig("m", urls, policy="round-robin"),), retry_backoff_s=0.0, **config)
    registry = ReplicaRegistry(cfg)
    for r in registry.replicas():
        r.ready = True
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return registry, Dispatcher(registry, cfg, client, RouterMetrics(registry)), client


def served_by(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}"


async def relay_all(d, metrics) -> list[bytes]:
    settled = []

    async def settle(status, prompt, completion, cached=0):
        settled.append((status, prompt, completion))

    relay = StreamRelay(d, False, settle, metrics, lambda _r: None)
    out = [chunk async for chunk in relay]
    assert len(settled) == 1
    return out, settled[0]


BAD = {
    "refused": lambda: (_ for _ in ()).throw(httpx.ConnectError("refused")),
    "status 500": lambda: httpx.Response(500, json={"error": {"message": "boom"}}),
    "status 503": lambda: httpx.Response(503, json={"error": {"message": "overloaded"}}),
    "role chunk, then a clean end": lambda: httpx.Response(200, content=sse(ROLE),
                                                           headers={"content-type": "text/event-stream"}),
    "in-band error before a token": lambda: httpx.Response(
        200, content=sse(ROLE, {"error": {"message": "engine died", "code": "engine_dead"}}, "[DONE]"),
        headers={"content-type": "text/event-stream"}),
}


@pytest.mark.parametrize("failure", list(BAD))
def test_retries_before_the_first_token_and_never_leaks_tickets(failure):
    """Replica a fails before any token in one of several ways; b answers. Round-robin tries a first."""
    def handler(request):
        if served_by(request) == "http://a":
            return BAD[failure]()
        return httpx.Response(200, content=GOOD, headers={"content-type": "text/event-stream"})

    registry, dispatcher, client = world(handler)
    group = registry.resolve("m")

    async def run():
        d = await dispatcher.dispatch(group, "/v1/chat/completions", {}, {}, RouteContext(5, 10), stream=True)
        assert d.replica.url == "http://b" and d.attempts == 2
        out, settled = await relay_all(d, dispatcher.metrics)
        await client.aclose()
        return out, settled

    out, settled = asyncio.run(run())
    assert out[-1] == b"data: [DONE]\n\n" and not any(b"usage" in o for o in out), "usage dropped when unasked"
    assert not any(b"engine died" in o for o in out), "nothing from the failed try reaches the client"
    assert settled == (200, 5, 1)
    assert all(r.outstanding_tokens == 0 and r.in_flight == 0 for r in registry.replicas())
    # a 500 is what the request made the replica do: retried, but not a replica fault (dispatch.py)
    assert registry.replicas()[0].breaker.consecutive_failures == (0 if failure == "status 500" else 1)
    registry.check_invariants()


def test_a_replica_failing_after_the_first_token_ends_the_stream_with_an_error_event():
    def handler(request):
        return httpx.Response(200, content=sse(ROLE, TOKEN, TOKEN), headers={"content-type": "text/event-stream"})

    registry, dispatcher, client = world(handler, ("http://a",))

    async def run():
        d = await dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(5, 10), True)
        out, settled = await relay_all(d, dispatcher.metrics)
        await client.aclose()
        return out, settled

    out, settled = asyncio.run(run())
    assert out[-1] == b"data: [DONE]\n\n" and b"upstream_error" in out[-2]
    assert sum(b'"hi"' in o for o in out) == 2 and settled[0] == 502
    assert registry.replicas()[0].in_flight == 0


def test_a_cancelled_half_open_probe_is_released():
    gate = asyncio.Event()

    async def handler(request):
        await gate.wait()
        return httpx.Response(200, content=GOOD, headers={"content-type": "text/event-stream"})

    registry, dispatcher, client = world(handler, ("http://a",))
    rep = registry.replicas()[0]
    for _ in range(3):
        rep.breaker.record_failure(0.0)
    rep.breaker.opened_at = -100.0  # cooled down: the next request is the half-open probe

    async def run():
        task = asyncio.create_task(dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(1, 1), True))
        await asyncio.sleep(0.05)
        assert not rep.breaker.available(0.0), "the probe is out"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()

    asyncio.run(run())
    assert rep.breaker.available(0.0) and rep.in_flight == 0, "a cancelled probe must not eject the replica for good"


def test_echo_chunks_are_not_the_first_token():
    echo = {"choices": [{"index": 0, "text": "The prompt", "finish_reason": None}]}
    first = {"choices": [{"index": 0, "text": " answer", "finish_reason": None}]}
    body = sse(echo, first, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, "[DONE]")

    def handler(request):
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    registry, dispatcher, client = world(handler, ("http://a",))

    async def run():
        d = await dispatcher.dispatch(registry.resolve("m"), "/v1/completions", {}, {},
                                      RouteContext(3, 10, echo_chunks=1), True)
        assert len(d.head) == 2 and d.first_token_at is not None, "the echo chunk did not end the head"
        out, settled = await relay_all(d, dispatcher.metrics)
        await client.aclose()
        return settled

    assert asyncio.run(run()) == (200, None, 1)


def test_all_replicas_failing_is_a_502_and_the_budget_stops_retry_storms():
    def handler(request):
        return httpx.Response(503, json={"error": {"message": "busy"}})

    registry, dispatcher, client = world(handler, ("http://a", "http://b"), retry_budget_min=1.0,
                                         retry_budget_ratio=0.0, breaker_failures=100)

    async def run():
        group = registry.resolve("m")
        with pytest.raises(APIError) as first:
            await dispatcher.dispatch(group, "/x", {}, {}, RouteContext(1, 1), False)
        with pytest.raises(APIError) as second:
            await dispatcher.dispatch(group, "/x", {}, {}, RouteContext(1, 1), False)
        await client.aclose()
        return first.value, second.value

    first, second = asyncio.run(run())
    assert first.status == 502 and second.status == 502
    assert dispatcher.budget.spent == 1 and dispatcher.budget.denied == 1, "one retry in the budget, then none"
    assert all(r.in_flight == 0 and r.breaker.available(0.0) for r in registry.replicas())


def test_poller_survives_unreadable_answers():
    answers = {"/ready": httpx.Response(200, json={"status": "ok"})}

    def handler(request):
        return answers.get(request.url.path) or httpx.Response(200, text="<html>proxy error</html>")

    registry, _, client = world(handler, ("http://a",), poll_failures=2)
    poller = HealthPoller(registry, registry.config, client)
    rep = registry.replicas()[0]

    async def run(n: int):
        for _ in range(n):
            await poller.poll_once()  # must not raise

    asyncio.run(run(2))  # /ready fine, /load garbage: still in rotation
    assert rep.ready
    answers["/ready"] = httpx.Response(503, text="<html>bad gateway</html>")
    answers["/load"] = httpx.Response(200, json=[1, 2])
    asyncio.run(run(2))
    assert not rep.ready
    asyncio.run(client.aclose())


def test_a_load_answer_with_a_renamed_field_is_unreadable():
    """The poller reads /load strictly: an answer that lacks a field (renamed on one side) is a
    failed poll, and the replica keeps its last readable load instead of reading as idle."""
    good = dataclasses.replace(LoadReport.empty(), num_waiting=7).to_json() | {"block_size": 16}
    answers = {"/ready": httpx.Response(200, json={"status": "ok"}), "/load": httpx.Response(200, json=good)}
    registry, _, client = world(lambda request: answers[request.url.path], ("http://a",), poll_failures=3)
    poller = HealthPoller(registry, registry.config, client)
    rep = registry.replicas()[0]
    asyncio.run(poller.poll_once())
    assert rep.load.num_waiting == 7 and rep.poll_failures == 0 and rep.block_size == 16
    renamed = {("waiting" if k == "num_waiting" else k): v for k, v in good.items()}
    answers["/load"] = httpx.Response(200, json=renamed | {"block_size": 32})
    asyncio.run(poller.poll_once())
    assert rep.poll_failures == 1 and rep.ready, "one unreadable answer is one failed poll"
    assert rep.load.num_waiting == 7 and rep.block_size == 16, "nothing read from the unreadable answer"
    asyncio.run(client.aclose())
