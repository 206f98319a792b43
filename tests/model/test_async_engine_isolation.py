"""AsyncEngine keys requests by internal ids: a repeated caller id never collides, and closing a
stream (even one never iterated) aborts its request. On the real SmolLM2 engine."""

from __future__ import annotations

import asyncio

import pytest

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.fanout import Fanout
from tests.conftest import engine_like, requires_smollm2

pytestmark = requires_smollm2
PROMPT = [1, 504, 3458, 314, 253]


@pytest.fixture
def async_engine(llm_fp32):
    engine = AsyncEngine(engine_like(llm_fp32), idle_wait_s=0.05)
    engine.start()
    yield engine
    engine.shutdown()
    assert engine.error is None


async def _drain(stream) -> list:
    return [out async for out in stream]


async def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while engine.engine.has_unfinished_requests() or engine._commands:
        assert asyncio.get_running_loop().time() < deadline, "engine still busy"
        await asyncio.sleep(0.01)


def test_same_request_id_twice_both_complete(async_engine):
    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        first = await async_engine.add_request("trace-1", PROMPT, params)
        second = await async_engine.add_request("trace-1", PROMPT, params)
        a, b = await asyncio.gather(_drain(first), _drain(second))
        return a, b

    a, b = asyncio.run(run())
    for outs in (a, b):
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
        assert all(out.request_id == "trace-1" for out in outs)  # the caller's id, not the key
    assert a[-1].outputs[0].token_ids == b[-1].outputs[0].token_ids
    async_engine.engine.scheduler.check_invariants()


def test_rejected_child_aborts_admitted_siblings(async_engine):
    """One prompt the engine rejects: the siblings already admitted must not keep generating."""
    vocab = async_engine.engine.vocab_size

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, n=4)
        fanout = Fanout(async_engine, "req", [PROMPT, PROMPT[:-1] + [vocab + 5]], params)
        with pytest.raises(RequestRejected):
            await fanout.start()
        before = async_engine.engine.generation_tokens_total
        await _wait_idle(async_engine)
        return before

    before = asyncio.run(run())
    # At most a step or two ran before the aborts landed; 4 siblings x 200 tokens never did.
    assert async_engine.engine.generation_tokens_total - before < 4 * 10
    assert async_engine.engine.block_manager.num_free_blocks == async_engine.engine.block_manager.num_blocks
    async_engine.engine.scheduler.check_invariants()


def test_closing_an_unread_stream_aborts(async_engine):
    async def run():
        stream = await async_engine.add_request("x", PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.aclose()
        await _wait_idle(async_engine)

    asyncio.run(run())
    assert not async_engine.engine.has_unfinished_requests()
    assert async_engine._queues == {}
