"""AsyncEngine on a fake engine (no model): request keys, stream closing, rejection, cancellation
and a crashing loop, with check_invariants() after every operation."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.client import EngineDeadError
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.load_report import LoadReport
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput
from ferrylm.sampling_params import SamplingParams


@dataclass
class FakeEngine:
    """Emits one token per step per request until max_tokens; prompt [0] is rejected; a step
    raises once `crash` is set."""

    config: object = field(default_factory=lambda: SimpleNamespace(model="fake", cache=SimpleNamespace(block_size=16)))
    tokenizer: object = None
    vocab_size: int = 100
    max_model_len: int = 64
    requests: dict = field(default_factory=dict)  # key -> [generated, max_tokens]
    aborted: list = field(default_factory=list)
    crash: bool = False

    def executor_dead(self):
        return None  # nothing runs apart from this engine

    def add_request(self, key, prompt, params, priority=0, output_kind=None, lora_name=None):
        if prompt == [0]:
            raise RequestRejected("no", "prompt")
        self.requests[key] = [0, params.max_tokens]

    def abort(self, key):
        if key not in self.requests:
            return None
        self.aborted.append(key)  # before the pop: a test polling `requests` from another thread
        del self.requests[key]  # must never see it gone but not yet recorded
        return RequestOutput(key, None, [], [CompletionOutput(0, "", [], FinishReason.ABORT)], True)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def resolve_max_tokens(self, params, prompt_len):
        return params.max_tokens

    def step(self):
        if self.crash:
            raise RuntimeError("kernel fault")
        outs = []
        for key, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outs.append(RequestOutput(key, None, [], [CompletionOutput(
                0, "x", [7], FinishReason.LENGTH if done else None, text_delta="x", token_ids_delta=[7])], done))
            if done:
                del self.requests[key]
        return outs

    def stats(self):
        zero = {f: 0 for f in LoadReport.__dataclass_fields__ if f not in ("healthy", "max_num_seqs")}
        return LoadReport(**(zero | {"num_running": len(self.requests), "max_num_seqs": None}))


@pytest.fixture
def engine():
    fake = FakeEngine()
    ae = AsyncEngine(fake, idle_wait_s=0.01)
    ae.start()
    yield ae
    ae.shutdown()


async def _idle(ae: AsyncEngine) -> None:
    for _ in range(500):
        if not ae._commands and not ae.engine.requests:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("engine never went idle")


def test_same_label_twice_gets_distinct_keys_and_own_outputs(engine):
    async def run():
        a = await engine.add_request("dup", [1, 2], SamplingParams(max_tokens=3))
        b = await engine.add_request("dup", [1, 2], SamplingParams(max_tokens=5))
        assert a.key != b.key
        engine.check_invariants()
        outs_a = [o async for o in a]
        outs_b = [o async for o in b]
        await _idle(engine)
        engine.check_invariants()
        return outs_a, outs_b

    outs_a, outs_b = asyncio.run(run())
    assert len(outs_a) == 3 and len(outs_b) == 5
    assert all(o.request_id == "dup" for o in outs_a + outs_b)
    assert engine._queues == {}


def test_closing_unread_stream_aborts_it(engine):
    async def run():
        s = await engine.add_request("x", [1], SamplingParams(max_tokens=10_000))
        await s.aclose()
        await _idle(engine)
        engine.check_invariants()
        return s.key

    key = asyncio.run(run())
    assert engine.engine.aborted == [key] and engine._queues == {}


def test_rejection_raises_and_leaves_nothing(engine):
    async def run():
        with pytest.raises(RequestRejected) as e:
            await engine.add_request("bad", [0], SamplingParams(max_tokens=2))
        assert e.value.param == "prompt"
        await _idle(engine)
        engine.check_invariants()

    asyncio.run(run())
    assert engine._queues == {}


def test_cancelled_while_waiting_for_admission_aborts(engine):
    async def run():
        engine.stall_for(0.3)  # the loop will not admit for a while
        await asyncio.sleep(0.05)
        task = asyncio.create_task(engine.add_request("c", [1], SamplingParams(max_tokens=10_000)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.4)
        await _idle(engine)
        engine.check_invariants()

    asyncio.run(run())
    assert engine._queues == {} and not engine.engine.requests


def test_crash_fails_every_stream_and_later_adds(engine):
    async def run():
        s = await engine.add_request("a", [1], SamplingParams(max_tokens=10_000))
        await s.__anext__()
        engine.engine.crash = True
        with pytest.raises(EngineDeadError):
            async for _ in s:
                pass
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], SamplingParams(max_tokens=2))

    asyncio.run(run())


def test_model_info_comes_from_the_engine(engine):
    info = engine.model_info
    assert (info.model, info.vocab_size, info.max_model_len, info.block_size) == ("fake", 100, 64, 16)


def test_engine_work_runs_on_the_loop_thread_and_fails_cleanly_once_it_ended():
    """KV transfer and adapter work (_between_steps) runs on the loop thread, the one thread with an
    OpenMP team (short_lived_thread.py); its errors reach the caller, the loop keeps going, and a
    call after the loop ended fails instead of waiting forever."""
    ae = AsyncEngine(FakeEngine(), idle_wait_s=0.01)

    async def run():
        before = await ae._between_steps(threading.current_thread)  # not started: a thread that ended
        before.join(5)
        assert before is not threading.main_thread() and not before.is_alive()
        ae.start()
        assert await ae._between_steps(threading.current_thread) is ae._thread

        def bad():
            raise ValueError("bad import")

        with pytest.raises(ValueError, match="bad import"):
            await ae._between_steps(bad)
        s = await ae.add_request("after", [1], SamplingParams(max_tokens=2))
        assert len([o async for o in s]) == 2  # the loop survived the failed call
        ae.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(ae._between_steps(lambda: 1), 5)

    asyncio.run(run())
