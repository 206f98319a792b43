"""The integration seam through a tiny in-process FastAPI app: admit before the (fake) engine,
finish after it, APIError rendered OpenAI-style, rate-limit headers on success, audit rows."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ferrylm.gateway import Gateway
from ferrylm.http.error_handlers import install_error_handlers


def build_app(gateway: Gateway, engine_calls: list[str], stats=None) -> FastAPI:
    """What the real server will do, with a fake completion instead of the engine."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        prompt_tokens, max_tokens = len(body["prompt"].split()), body.get("max_tokens", 16)
        admission = await gateway.admit(request.headers, request.client.host if request.client else None,
                                        body["model"], prompt_tokens, max_tokens, stats)
        engine_calls.append(admission.request_id)  # engine.add_request(..., priority=admission.priority)
        completion_tokens = min(max_tokens, 5)
        await gateway.finish(admission, 200, prompt_tokens, completion_tokens, prompt=body["prompt"])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return JSONResponse({"id": admission.request_id, "object": "text_completion", "model": body["model"],
                             "choices": [{"index": 0, "text": "fake", "finish_reason": "length"}], "usage": usage},
                            headers=admission.response_headers)

    return app


def post(app: FastAPI, key: str | None, model: str = "small", prompt: str = "one two three", max_tokens: int = 16):
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("203.0.113.7", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return await client.post("/v1/completions", headers=headers,
                                     json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
    return asyncio.run(go())


def test_good_key_is_served_and_audited(make_gateway, store):
    store.create_tenant("acme", tpm=10_000, rpm=60, models=("small",))
    key = store.create_key("acme")
    gw, calls = make_gateway(audit_prompts=True), []
    r = post(build_app(gw, calls), key[1])
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 8
    assert r.headers["x-ratelimit-limit-tokens"] == "10000" and r.headers["x-ratelimit-remaining-requests"] == "59"
    assert r.headers["x-ratelimit-remaining-tokens"] == str(10_000 - 19)  # reserved 3 + 16 at admission
    record = gw.audit.recent(1)[0]
    assert (record.tenant, record.key_id, record.model, record.status) == ("acme", key[0].key_id, "small", 200)
    assert (record.prompt_tokens, record.completion_tokens, record.client_addr) == (3, 5, "203.0.113.7")
    assert record.prompt == "one two three" and record.request_id == r.json()["id"]
    assert gw.in_flight == 0 and len(calls) == 1
    gw.check_invariants()


def test_prompts_are_not_stored_by_default(make_gateway, store):
    store.create_tenant("acme")
    key = store.create_key("acme")[1]
    gw = make_gateway()
    assert post(build_app(gw, []), key).status_code == 200
    assert gw.audit.recent(1)[0].prompt is None


def test_errors_render_openai_style(make_gateway, store):
    store.create_tenant("acme", tpm=40, models=("small",))
    key = store.create_key("acme")[1]
    gw, calls = make_gateway(), []
    app = build_app(gw, calls)
    r = post(app, None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert post(app, "fl-000000000000-nope").status_code == 401
    r = post(app, key, model="large")
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert post(app, key, max_tokens=30).status_code == 200  # reserves 33 of 40, uses 8
    r = post(app, key, max_tokens=35)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-tokens"] == "40"
    assert len(calls) == 1  # no refused request reached the "engine"
    statuses = [rec.status for rec in gw.audit.recent(10)]
    assert statuses == [429, 200, 403]  # 401s are not audited (no tenant; would let floods fill the log)


def test_open_server_admits_anonymous_callers(make_gateway):
    gw, calls = make_gateway(require_auth=False), []
    app = build_app(gw, calls)
    assert post(app, None).status_code == 200
    assert post(app, "EMPTY").status_code == 200  # what openai clients send when no key is needed
    assert {rec.tenant for rec in gw.audit.recent(5)} == {"anonymous"}


def test_cancelled_admit_releases_its_admission(make_gateway, store):
    store.create_tenant("acme", max_concurrency=1)
    key = store.create_key("acme")[1]
    gw = make_gateway()

    async def go() -> None:
        task = asyncio.create_task(gw.admit({"authorization": f"Bearer {key}"}, None, "m", 1, 1, None))
        await asyncio.sleep(0)
        task.cancel()
        for _ in range(500):
            await asyncio.sleep(0.005)
            if task.done() and gw.in_flight == 0 and gw.concurrency.total() == 0:
                break
        gw.check_invariants()
        admission = await gw.admit({"authorization": f"Bearer {key}"}, None, "m", 1, 1, None)  # the slot is free
        await gw.finish(admission, 200, 1, 1)

    asyncio.run(go())
    assert gw.in_flight == 0
