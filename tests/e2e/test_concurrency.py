"""64 concurrent streaming clients all finish with the offline LLM's greedy outputs."""

from __future__ import annotations

import asyncio

from tests.conftest import requires_smollm2
from tests.e2e import offline

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
NUM_CLIENTS = 64
MAX_TOKENS = 6


async def one_stream(client, i: int) -> tuple[str, str | None, set[str]]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell me one fact about the number {i}."}],
        temperature=0, max_tokens=MAX_TOKENS, stream=True)
    text, finish, ids = "", None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish, ids


async def run_all(server) -> list[tuple[str, str | None, set[str]]]:
    async with server.async_client() as client:
        return await asyncio.gather(*(one_stream(client, i) for i in range(NUM_CLIENTS)))


def test_64_concurrent_streams(api_server, llm_fp32):
    before = api_server.wait_idle()
    results = asyncio.run(run_all(api_server))
    conversations = [[{"role": "user", "content": f"Tell me one fact about the number {i}."}]
                     for i in range(NUM_CLIENTS)]
    expected = offline.chat(llm_fp32, conversations, temperature=0.0, max_tokens=MAX_TOKENS)
    assert [r[0] for r in results] == [e.outputs[0].text for e in expected]
    assert all(r[1] == e.outputs[0].finish_reason.value for r, e in zip(results, expected))
    assert len({next(iter(r[2])) for r in results}) == NUM_CLIENTS and all(len(r[2]) == 1 for r in results)

    after = api_server.wait_idle()
    finished = sum(after.get(f"ferrylm:request_success_total{{finished_reason={r}}}", 0) for r in ("stop", "length"))
    finished_before = sum(before.get(f"ferrylm:request_success_total{{finished_reason={r}}}", 0)
                          for r in ("stop", "length"))
    assert finished - finished_before == NUM_CLIENTS
    assert after["ferrylm:time_to_first_token_seconds_count"] - before["ferrylm:time_to_first_token_seconds_count"] \
        == NUM_CLIENTS
    assert after["ferrylm:generation_tokens_total"] - before["ferrylm:generation_tokens_total"] == sum(
        len(e.outputs[0].token_ids) for e in expected)
