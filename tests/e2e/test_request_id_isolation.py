"""A client's X-Request-Id is a label, never the engine's key (M2.1 item 1), on a real server:
another request with the same header, from anyone, neither fails nor hangs the first, and an id
like the readiness probe's cannot take the replica out of rotation."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import requires_smollm2

pytestmark = requires_smollm2
MODEL = "smollm2-135m"


def _chat(max_tokens: int, n: int = 1, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, "n": n, "stream": stream}


async def _stream_after_first_chunk(client: httpx.AsyncClient, started: asyncio.Event) -> tuple[list, str]:
    events, finish = [], None
    async with client.stream("POST", "/v1/chat/completions", json=_chat(48, stream=True),
                             headers={"X-Request-Id": "trace-1"}) as resp:
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-1"
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] != "[DONE]":
                chunk = json.loads(line[6:])
                assert chunk["id"] == "trace-1"
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    started.set()
                finish = (chunk["choices"][0]["finish_reason"] if chunk["choices"] else None) or finish
    return events, finish


def test_same_x_request_id_neither_fails_nor_hangs(api_server):
    before = api_server.wait_idle()

    async def run():
        async with httpx.AsyncClient(base_url=api_server.base_url, timeout=60) as client:
            started = asyncio.Event()
            first = asyncio.create_task(_stream_after_first_chunk(client, started))
            await asyncio.wait_for(started.wait(), 30)
            second = await client.post("/v1/chat/completions", json=_chat(8, n=8),
                                       headers={"X-Request-Id": "trace-1"})
            return await asyncio.wait_for(first, 60), second

    (events, finish), second = asyncio.run(run())
    assert second.status_code == 200, second.text
    body = second.json()
    assert body["id"] == "trace-1" and len(body["choices"]) == 8
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert events[-1] == "[DONE]" and finish == "length"
    after = api_server.wait_idle()
    # Exactly what the two requests asked for was generated: no orphaned siblings.
    assert after["ferrylm:generation_tokens_total"] - before["ferrylm:generation_tokens_total"] == 48 + 8 * 8


def test_probe_like_request_id_keeps_the_replica_ready(api_server):
    api_server.wait_idle()

    async def run():
        async with httpx.AsyncClient(base_url=api_server.base_url, timeout=120) as client:
            # 48 sequences under an id like the probe's: the server's 64 sequence slots leave the
            # probe (which jumps the queue) a slot, so only an id collision, not load, could fail it
            big = asyncio.create_task(client.post(
                "/v1/completions", headers={"X-Request-Id": "ready"},
                json={"model": MODEL, "prompt": "ok", "max_tokens": 4, "n": 48, "temperature": 0}))
            readies = []
            for _ in range(5):
                readies.append((await client.get("/ready")).status_code)
                await asyncio.sleep(0.05)
            return await big, readies

    big, readies = asyncio.run(run())
    assert big.status_code == 200, big.text
    assert len(big.json()["choices"]) == 48
    assert readies == [200] * 5
    api_server.wait_idle()
