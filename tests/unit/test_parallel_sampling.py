"""Parallel sampling (n > 1) in engine/parallel_sampling.py: child ids and seeds, children's deltas
folded back in index order; and its two users, the offline LLM and the server's Fanout, on fakes."""

from __future__ import annotations

import asyncio

import pytest

from ferrylm.engine.llm import LLM
from ferrylm.engine.parallel_sampling import ParentRequest, child_params
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.fanout import Fanout


def delta(rid: str, text: str, tokens: list[int], finished: bool = False,
          logprobs: list[dict[int, float]] | None = None) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    completion = CompletionOutput(0, text, tokens, reason, logprobs=logprobs, text_delta=text,
                                  token_ids_delta=list(tokens))
    return RequestOutput(rid, "p", [1, 2], [completion], finished)


def test_child_ids_and_params():
    params = SamplingParams(temperature=0.8, n=3, seed=7, max_tokens=5, stop=["x"])
    parent = ParentRequest("req", params)
    children = parent.children()
    assert [cid for cid, _ in children] == ["req-0", "req-1", "req-2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.max_tokens == 5 and p.stop == ["x"] and p.temperature == 0.8 for _, p in children)
    assert params.n == 3 and params.seed == 7  # the parent's params are not changed
    unseeded = ParentRequest("u", SamplingParams(n=2))
    assert [p.seed for _, p in unseeded.children()] == [None, None]
    assert child_params(params, 1) == parent.child_params(1)
    assert ParentRequest.output_kind is RequestOutputKind.DELTA


def test_merge_keeps_index_order_whatever_the_arrival_order():
    parent = ParentRequest("req", SamplingParams(n=3, logprobs=0))
    arrivals = [(2, delta("req-2", "c", [3], logprobs=[{3: -0.3}])),
                (0, delta("req-0", "a", [1], logprobs=[{1: -0.1}])),
                (2, delta("req-2", "C", [30], True, logprobs=[{30: -3.0}])),
                (1, delta("req-1", "b", [2], True, logprobs=[{2: -0.2}]))]
    for index, out in arrivals:
        parent.add(index, out)
        assert not parent.finished
    partial = parent.output()  # every child has an output, child 0 unfinished: it merges, unfinished
    assert not partial.finished and [c.text for c in partial.outputs] == ["a", "b", "cC"]
    assert parent.num_output_tokens == 4
    parent.add(0, delta("req-0", "A", [10], True, logprobs=[{10: -1.0}]))
    merged = parent.output()
    assert merged.finished and merged.request_id == "req" and merged.prompt_token_ids == [1, 2]
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    assert [c.text for c in merged.outputs] == ["aA", "b", "cC"]
    assert [c.token_ids for c in merged.outputs] == [[1, 10], [2], [3, 30]]
    assert merged.outputs[2].logprobs == [{3: -0.3}, {30: -3.0}]
    assert [c.token_ids_delta for c in merged.outputs] == [[10], [2], [30]]  # the last step's
    assert parent.child_output(1).outputs[0].index == 1


def test_output_before_every_child_spoke_raises():
    parent = ParentRequest("req", SamplingParams(n=2))
    assert parent.child_output(0) is None
    parent.add(0, delta("req-0", "a", [1], True))
    with pytest.raises(ValueError):
        parent.output()


class FakeEngine:
    """Child i of seed s emits (s % 3) + 1 one-token deltas; outputs come out in reverse id order."""

    def __init__(self) -> None:
        self.added: list[tuple[str, int | None, RequestOutputKind]] = []
        self.left: dict[str, int] = {}
        self.emitted: dict[str, int] = {}

    def add_request(self, rid, prompt, params, priority=0, output_kind=RequestOutputKind.CUMULATIVE, lora_name=None):
        self.added.append((rid, params.seed, output_kind))
        self.left[rid], self.emitted[rid] = params.seed % 3 + 1, 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid in sorted(self.left, reverse=True):
            self.left[rid] -= 1
            self.emitted[rid] += 1
            outs.append(delta(rid, f"{rid}.{self.emitted[rid]} ", [self.emitted[rid]], not self.left[rid]))
            if not self.left[rid]:
                del self.left[rid]
        return outs


def test_offline_llm_fans_out_and_merges():
    engine = FakeEngine()
    llm = LLM.from_engine(engine)
    outs = llm.generate(["p0", "p1"], [SamplingParams(n=3, seed=0), SamplingParams(n=1, seed=5)], use_tqdm=False)
    assert [(rid, seed) for rid, seed, _ in engine.added] == [("0-0", 0), ("0-1", 1), ("0-2", 2), ("1-0", 5)]
    assert all(kind is RequestOutputKind.DELTA for _, _, kind in engine.added)
    assert [o.request_id for o in outs] == ["0", "1"] and all(o.finished for o in outs)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [c.text for c in outs[0].outputs] == ["0-0.1 ", "0-1.1 0-1.2 ", "0-2.1 0-2.2 0-2.3 "]
    assert [c.token_ids for c in outs[0].outputs] == [[1], [1, 2], [1, 2, 3]]
    assert outs[1].outputs[0].text == "1-0.1 1-0.2 1-0.3 "


class FakeStream:
    def __init__(self, outputs: list[RequestOutput]):
        self._outputs = list(outputs)
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._outputs:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self._outputs.pop(0)

    async def aclose(self) -> None:
        self.closed = True


class FakeClient:
    def __init__(self) -> None:
        self.added: list[tuple[str, list[int], int | None]] = []

    async def add_request(self, rid, prompt, params, priority=0, output_kind=RequestOutputKind.CUMULATIVE,
                          lora_name=None):
        assert output_kind is RequestOutputKind.DELTA and params.n == 1
        self.added.append((rid, prompt, params.seed))
        return FakeStream([delta(rid, "x", [7]), delta(rid, rid, [8], True)])


def test_fanout_takes_ids_seeds_and_finals_from_parallel_sampling():
    async def run(prompts: list[list[int]]) -> tuple[FakeClient, list[RequestOutput], int]:
        client = FakeClient()
        fanout = Fanout(client, "cmpl", prompts, SamplingParams(n=2, seed=3))
        await fanout.start()
        seen = [index async for index, _ in fanout]
        await fanout.aclose()
        assert sorted(seen) == sorted(list(range(fanout.num_choices)) * 2)
        return client, fanout.finals(), fanout.num_completion_tokens

    client, finals, tokens = asyncio.run(run([[1]]))
    assert client.added == [("cmpl-0", [1], 3), ("cmpl-1", [1], 4)]  # one prompt: the plain ids
    assert [f.outputs[0].text for f in finals] == ["xcmpl-0", "xcmpl-1"] and tokens == 4
    client, finals, tokens = asyncio.run(run([[1], [2]]))
    assert client.added == [("cmpl-0-0", [1], 3), ("cmpl-0-1", [1], 4), ("cmpl-1-0", [2], 3), ("cmpl-1-1", [2], 4)]
    assert [f.outputs[0].token_ids for f in finals] == [[7, 8]] * 4 and tokens == 8
    assert [f.outputs[0].text for f in finals] == ["xcmpl-0-0", "xcmpl-0-1", "xcmpl-1-0", "xcmpl-1-1"]
