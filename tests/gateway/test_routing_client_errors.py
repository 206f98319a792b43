"""Client errors are answers, not replica faults: a replica's 4xx (or in-band
invalid_request_error) reaches the client as it came, is never retried and never counts toward the
breaker, and a half-open probe answered so is released undecided. Replica faults still count,
including an in-band engine error after the first token. Scripted replicas (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.testclient import TestClient

from ferrylm.http.errors import APIError
from ferrylm.load_report import LoadReport
from ferrylm.router import app as gateway_app
from ferrylm.router.breaker import BreakerState
from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig
from ferrylm.router.policies import RouteContext
from ferrylm.router.relay import StreamRelay
from tests.gateway.test_routing_dispatch import ROLE, TOKEN, served_by, sse, world

CLIENT_ERRORS = (400, 401, 403, 404, 413, 422, 429)
SSE = {"content-type": "text/event-stream"}


def error_body(status: int) -> dict:
    return {"error": {"message": f"replica says {status}", "type": "invalid_request_error",
                      "param": "temperature", "code": f"code_{status}"}}


async def _relay_stream(registry, dispatcher, client) -> tuple[list[bytes], list[tuple]]:
    """Dispatch one streamed request to group "m" and relay it whole: (chunks, settle calls)."""
    d = await dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(5, 10), True)
    settled = []

    async def settle(*args):
        settled.append(args)

    out = [c async for c in StreamRelay(d, False, settle, dispatcher.metrics, dispatcher.record_failure)]
    await client.aclose()
    return out, settled


@pytest.mark.parametrize("status", CLIENT_ERRORS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_4xx_is_the_answer_not_retried_not_counted(status, stream):
    sent: list[str] = []

    def handler(request):
        sent.append(served_by(request))
        return httpx.Response(status, json=error_body(status), headers={"retry-after": "3"})

    registry, dispatcher, client = world(handler, breaker_failures=3)

    async def run():
        results = []
        for _ in range(5):  # more than breaker_failures
            d = await dispatcher.dispatch(registry.resolve("m"), "/v1/chat/completions", {}, {},
                                          RouteContext(5, 10), stream)
            results.append((d.attempts, d.response.status_code, d.response.json(), d.client_error))
            await d.aclose()
        await client.aclose()
        return results

    results = asyncio.run(run())
    assert results == [(1, status, error_body(status), True)] * 5
    assert len(sent) == 5, "one try per request: another replica would refuse it too"
    for rep in registry.replicas():
        assert rep.breaker.state is BreakerState.CLOSED and rep.breaker.consecutive_failures == 0
        assert rep.in_flight == 0 and rep.outstanding_tokens == 0
    assert dispatcher.budget.spent == 0
    registry.check_invariants()


def test_a_4xx_keeps_the_failure_count_and_a_503_still_counts():
    answers = [503, 400, 400, 503, 503]

    def handler(request):
        status = answers.pop(0)
        return httpx.Response(status, json=error_body(status))

    registry, dispatcher, client = world(handler, ("http://a",), breaker_failures=3)
    rep = registry.replicas()[0]

    async def run():
        seen = []
        for _ in range(4):
            try:
                d = await dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(1, 1), False)
                seen.append(d.response.status_code)
                await d.aclose()
            except Exception as e:  # noqa: BLE001 - the 502 after the only replica failed
                seen.append(getattr(e, "status", e))
            seen.append(rep.breaker.consecutive_failures)
        await client.aclose()
        return seen

    # 503 → counted (the only replica: 502); 400s neither count nor reset; the next 503 makes two.
    assert asyncio.run(run()) == [502, 1, 400, 1, 400, 1, 502, 2]
    assert rep.breaker.state is BreakerState.CLOSED


def test_a_half_open_probe_answered_4xx_is_released_undecided():
    def handler(request):
        return httpx.Response(400, json=error_body(400))

    registry, dispatcher, client = world(handler, ("http://a",), breaker_failures=3)
    rep = registry.replicas()[0]
    for _ in range(3):
        rep.breaker.record_failure(0.0)
    rep.breaker.opened_at = -100.0  # cooled down: the next request is the half-open probe

    async def run():
        d = await dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(1, 1), False)
        assert d.response.status_code == 400
        await d.aclose()
        await client.aclose()

    asyncio.run(run())
    assert rep.breaker.state is BreakerState.HALF_OPEN, "a 4xx neither closes nor re-opens the breaker"
    assert rep.breaker.available(0.0), "the probe slot is free for the next request"
    assert rep.breaker.consecutive_failures == 3
    rep.breaker.check_invariants()


def test_an_in_band_client_error_before_a_token_is_relayed_not_retried():
    bad = {"error": {"message": "bad grammar", "type": "invalid_request_error", "param": None, "code": None}}
    sent: list[str] = []

    def handler(request):
        sent.append(served_by(request))
        return httpx.Response(200, content=sse(ROLE, bad, "[DONE]"), headers=SSE)

    registry, dispatcher, client = world(handler)

    out, settled = asyncio.run(_relay_stream(registry, dispatcher, client))
    assert len(sent) == 1 and b"bad grammar" in out[1] and out[-1] == b"data: [DONE]\n\n"
    assert settled[0][0] == 400
    assert all(r.breaker.consecutive_failures == 0 and r.in_flight == 0 for r in registry.replicas())


def test_an_in_band_engine_error_after_the_first_token_counts_toward_the_breaker():
    boom = {"error": {"message": "engine died", "type": "server_error", "param": None, "code": "engine_dead"}}

    def handler(request):
        return httpx.Response(200, content=sse(ROLE, TOKEN, boom, "[DONE]"), headers=SSE)

    registry, dispatcher, client = world(handler, ("http://a",))

    out, settled = asyncio.run(_relay_stream(registry, dispatcher, client))
    assert b"engine died" in out[-2] and settled[0][0] == 503
    assert registry.replicas()[0].breaker.consecutive_failures == 1


def _refused(registry, dispatcher, client, times: int) -> None:
    """Dispatch `times` requests to group "m", each failing on every replica (an APIError)."""
    async def run():
        for _ in range(times):
            with pytest.raises(APIError):
                await dispatcher.dispatch(registry.resolve("m"), "/x", {}, {}, RouteContext(5, 10), False)
        await client.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("status", [500, 501, 505])
def test_a_500_is_retried_elsewhere_but_never_ejects_a_replica(status):
    """A request whose content makes replicas fail (500): retried within the budget, but one tenant
    repeating it must not eject the replicas everyone else is using."""
    def handler(request):
        return httpx.Response(status, json={"error": {"message": "boom", "type": "server_error", "param": None,
                                                      "code": None}})

    registry, dispatcher, client = world(handler, breaker_failures=2)
    _refused(registry, dispatcher, client, 6)
    for rep in registry.replicas():
        assert rep.breaker.state is BreakerState.CLOSED and rep.breaker.consecutive_failures == 0
        rep.breaker.check_invariants()


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_502_503_504_counts_toward_the_breaker(status):
    registry, dispatcher, client = world(lambda request: httpx.Response(status), ("http://a",), breaker_failures=2)
    _refused(registry, dispatcher, client, 2)
    assert registry.replicas()[0].breaker.state is BreakerState.OPEN


def test_an_in_band_server_error_that_is_not_engine_death_is_not_counted():
    boom = {"error": {"message": "output could not be shaped", "type": "server_error", "param": None, "code": None}}

    def handler(request):
        return httpx.Response(200, content=sse(ROLE, TOKEN, boom, "[DONE]"), headers=SSE)

    registry, dispatcher, client = world(handler, ("http://a",))
    out, settled = asyncio.run(_relay_stream(registry, dispatcher, client))
    assert settled[0][0] == 500 and registry.replicas()[0].breaker.consecutive_failures == 0


def scripted_fleet(monkeypatch, chat_answer) -> TestClient:
    """The real gateway app whose HTTP client reaches a scripted replica at http://r."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/load":
            body = LoadReport.empty().to_json() | {"block_size": 16, "max_model_len": 2048, "models": ["m"]}
            return httpx.Response(200, json=body)
        return chat_answer(request)

    real = httpx.AsyncClient
    monkeypatch.setattr(gateway_app.httpx, "AsyncClient",
                        lambda **kw: real(transport=httpx.MockTransport(handler), **kw))
    router = RouterConfig((GroupConfig("m", ("http://r",), tokenizer="/nonexistent"),), poll_interval_s=0.05,
                          retry_backoff_s=0.0)
    return TestClient(gateway_app.build_gateway_app(GatewayServerConfig(router)))


@pytest.mark.parametrize("status", CLIENT_ERRORS)
def test_the_gateway_passes_a_replica_4xx_through_verbatim(monkeypatch, status):
    raw = json.dumps(error_body(status), indent=1).encode()  # byte-exact, odd formatting and all
    ok = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    calls = []

    def answer(request):
        calls.append(json.loads(request.content))
        if len(calls) <= 5:
            return httpx.Response(status, content=raw, headers={"content-type": "application/json",
                                                                "retry-after": "7"})
        return httpx.Response(200, json=ok)

    with scripted_fleet(monkeypatch, answer) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(5):  # more than breaker_failures (3)
            r = http.post("/v1/chat/completions", json=body)
            assert (r.status_code, r.content, r.headers["retry-after"]) == (status, raw, "7")
        assert len(calls) == 5, "never retried"
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        rep = http.app.state.ferry.registry.replicas()[0]
        assert not rep.ejected and rep.breaker.consecutive_failures == 0
        cards = http.get("/v1/models").json()["data"]
        assert cards[0]["max_model_len"] == 2048, "the replicas' context window, from /load"
