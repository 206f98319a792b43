"""Tenant fairness on a real `ferrylm serve` with auth: a batch-tier tenant's burst cannot starve a
premium tenant. The premium requests sent mid-flood get their first token before most of the
flood's queued requests start (tier → engine priority), every flood request still completes, and
the flood on a small KV pool is served by swap preemption (victims are the low-priority requests)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess, make_keys

pytestmark = requires_smollm2

MAX_SEQS = 4
FLOOD, FLOOD_TOKENS = 12, 40
PREMIUM, PREMIUM_TOKENS = 3, 6


@pytest.fixture(scope="module")
def fair_server(tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('fair') / 'state.db'}"
    keys = make_keys(db, {"noisy": {"tier": "batch"}, "vip": {"tier": "premium"}})
    # 10 blocks of 16 tokens, whatever the CPU's default dtype: four flood requests (3 blocks each) outgrow it
    server = ServerProcess("--model", "smollm2-135m", "--require-auth", "--state-db", db, "--no-admission-control",
                           "--max-num-seqs", str(MAX_SEQS), "--max-num-batched-tokens", "256",
                           "--num-gpu-blocks-override", "10", "--preemption-mode", "swap", "--swap-space", "0.05")
    server.wait_ready()
    yield server, keys
    assert server.stop() == 0


async def _stream(client: httpx.AsyncClient, key: str, text: str, max_tokens: int) -> dict:
    """One streamed completion: when it was sent, when its first text came, tokens generated."""
    body = {"model": "smollm2-135m", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    first = first or time.monotonic()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return {"sent": sent, "first": first, "tokens": tokens}


async def _until_queued(client: httpx.AsyncClient, n: int) -> None:
    for _ in range(400):
        text = (await client.get("/metrics")).text
        waiting = next(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("ferrylm:num_requests_waiting{"))
        if waiting >= n:
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"the flood never queued {n} requests")


def test_premium_tenant_is_not_starved_by_a_batch_flood(fair_server):
    server, keys = fair_server

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            flood = [asyncio.create_task(_stream(client, keys["noisy"], f"Story {i}: once upon a time,",
                                                 FLOOD_TOKENS)) for i in range(FLOOD)]
            await _until_queued(client, FLOOD - MAX_SEQS - 1)  # the flood fills the batch and the queue
            vip = await asyncio.gather(*(_stream(client, keys["vip"], f"Question {i}: what is 2 + {i}?",
                                                 PREMIUM_TOKENS) for i in range(PREMIUM)))
            return await asyncio.gather(*flood), vip

    flood, vip = asyncio.run(run())
    assert all(r["tokens"] == FLOOD_TOKENS for r in flood)  # the flood is served in full, not starved
    assert all(r["tokens"] == PREMIUM_TOKENS for r in vip)
    vip_done = max(r["first"] for r in vip)
    queued = FLOOD - MAX_SEQS  # flood requests that had no batch slot when the premium ones came
    started_after = sum(r["first"] > vip_done for r in flood)
    assert started_after >= queued - 2, (started_after, queued)  # FIFO would put all of them first
    vip_ttft = statistics.median(r["first"] - r["sent"] for r in vip)
    queued_wait = statistics.median(sorted(r["first"] - r["sent"] for r in flood)[MAX_SEQS:])
    assert vip_ttft < queued_wait, (vip_ttft, queued_wait)
    m = server.wait_idle()
    assert m["ferrylm:num_swapped_out_total"] > 0 and m["ferrylm:num_swapped_in_total"] == \
        m["ferrylm:num_swapped_out_total"]
    assert m["ferrylm:num_requests_swapped"] == 0
