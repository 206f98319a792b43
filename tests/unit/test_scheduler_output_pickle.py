"""A SchedulerOutput is plain data (executor.py's seam): tensor parallelism pickles one every step to
the other ranks, so nothing in it may be a Future, a lock or a handle. Built here by the real
scheduler from requests using every feature at once, then pickled."""

from __future__ import annotations

import pickle
from concurrent.futures import Future

from ferrylm.config import EngineConfig
from ferrylm.engine.engine import Engine
from ferrylm.sampling_params import SamplingParams, StructuredOutputsParams
from ferrylm.tokenizer import Tokenizer
from tests.gpu.random_model import StandInVocab


class _Executor:
    num_blocks, num_host_blocks, swap_bytes_per_block = 64, 0, 0
    vocab_size = 100
    eos_token_ids = [0]

    def use_grammars(self, compiled) -> None:
        self.compiled = compiled


class _Grammars:
    """Every constraint compiled at once (a stand-in for GrammarCompiler: no tokenizer here)."""

    def submit(self, spec, waiting=False) -> Future:
        future: Future = Future()
        future.set_result(object())  # an unpicklable compiled grammar: it must stay on this side
        return future

    def compiled(self, ref):
        raise AssertionError("not called without a runner")

    def shutdown(self) -> None:
        pass


def test_a_step_with_every_feature_pickles_to_equal_plain_data() -> None:
    engine = Engine(EngineConfig(), _Executor(), Tokenizer(StandInVocab(100), (0,)), max_model_len=256,
                    grammars=_Grammars())
    every = SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5,
                           frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={3: 1.0}, seed=7,
                           max_tokens=8, stop=["x"], stop_token_ids=[4], logprobs=2,
                           prompt_logprobs=1, cache_salt="tenant-a",
                           structured_outputs=StructuredOutputsParams(json='{"type": "object"}'))
    engine.add_request("schema", list(range(1, 40)), every)
    engine.add_request("regex", [5, 6, 7], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    engine.add_request("choice", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(choice=("a", "b"))))
    engine.add_request("plain", [9, 9, 9], SamplingParams(max_tokens=4))
    step = engine.scheduler.schedule()
    assert len(step.new_requests) == 4 and {r.grammar is not None for r in step.new_requests} == {True, False}
    data = pickle.dumps(step)
    assert pickle.loads(data) == step
    refs = {r.request_id: r.grammar for r in step.new_requests}
    assert refs["schema"] == every.structured_outputs.ref() and refs["plain"] is None
    assert isinstance(refs["regex"], str) and refs["regex"] != refs["choice"]
