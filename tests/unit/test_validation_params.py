"""User errors are rejected when a request is built or admitted, never inside Engine.step (issue M2.1).

SamplingParams rejects non-finite floats and non-integer ids (json.loads accepts NaN/Infinity, so a
client can send them); Engine.add_request checks ids against the vocabulary, so the sampler, which
runs inside the engine loop where any exception is fatal, can trust what it is given.
"""

from __future__ import annotations

import math

import pytest

from ferrylm.config import EngineConfig
from ferrylm.engine.engine import Engine
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from tests.conftest import requires_smollm2

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_non_finite_float_is_rejected_naming_the_param(name: str, value: float) -> None:
    with pytest.raises(SamplingParamsError, match="finite") as err:
        SamplingParams(**{name: value})
    assert err.value.param == name


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_logit_bias_is_rejected(value: float) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias={5: value})
    assert err.value.param == "logit_bias"


def test_extreme_but_finite_values_are_accepted() -> None:
    params = SamplingParams(repetition_penalty=5e-324, temperature=1e-300, min_p=1e-300, top_p=1e-300)
    assert params.repetition_penalty == 5e-324
    assert SamplingParams(repetition_penalty=1e300).repetition_penalty == 1e300


@pytest.mark.parametrize("kwargs,param", [
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: "high"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
    ({"logprobs": 2.0}, "logprobs"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": 4.0}, "max_tokens"),
])
def test_wrong_types_are_rejected_naming_the_param(kwargs: dict, param: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_openai_style_string_logit_bias_keys_become_ids() -> None:
    assert SamplingParams(logit_bias={"50": -2.0, 7: 1}).logit_bias == {50: -2.0, 7: 1}


def test_request_rejected_carries_an_optional_param() -> None:
    assert RequestRejected("too long").param is None
    assert RequestRejected("bad id", "prompt").param == "prompt"


# ---------------------------------------------------------------- the engine boundary


class _Executor:
    """The executor.Executor attributes Engine reads at construction; no model, no tensors."""

    num_blocks, num_host_blocks, swap_bytes_per_block = 16, 0, 0
    vocab_size = 100
    eos_token_ids: list[int] = []

    def use_grammars(self, compiled) -> None:
        pass


def stub_engine() -> Engine:
    return Engine(EngineConfig(), _Executor(), tokenizer=None, max_model_len=64)


@pytest.mark.parametrize("kwargs,param", [
    ({"logit_bias": {100: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
])
def test_out_of_vocab_ids_are_rejected_at_add_request(kwargs: dict, param: str) -> None:
    engine = stub_engine()
    with pytest.raises(SamplingParamsError) as err:
        engine.add_request("r", [1, 2, 3], SamplingParams(**kwargs))
    assert err.value.param == param
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt", [[1, 100], [1, -3], [1, 2.0]])
def test_bad_prompt_ids_are_rejected_with_param_prompt(prompt: list) -> None:
    engine = stub_engine()
    with pytest.raises(RequestRejected) as err:
        engine.add_request("r", prompt, SamplingParams())
    assert err.value.param == "prompt"


def test_params_changed_after_construction_are_revalidated() -> None:
    params = SamplingParams()
    params.repetition_penalty = float("inf")
    with pytest.raises(SamplingParamsError) as err:
        stub_engine().add_request("r", [1, 2], params)
    assert err.value.param == "repetition_penalty"


@requires_smollm2
def test_offline_engine_rejects_out_of_vocab_logit_bias_and_keeps_serving(llm_fp32) -> None:
    engine = llm_fp32.engine
    vocab = engine.vocab_size
    with pytest.raises(SamplingParamsError) as err:
        engine.add_request("bad", "Hello", SamplingParams(logit_bias={vocab: 5.0}, max_tokens=2))
    assert err.value.param == "logit_bias"
    assert not engine.has_unfinished_requests()
    out = llm_fp32.generate("Hello", SamplingParams(temperature=0.0, max_tokens=3, logit_bias={vocab - 1: 1.0},
                                                    repetition_penalty=1e-300, logprobs=2), use_tqdm=False)
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 3 and all(0 <= t < vocab for t in completion.token_ids)
    assert all(math.isfinite(v) for entries in completion.logprobs for v in entries.values())
