"""Extreme but valid sampling parameters (issue M2.1 item 2): no NaN/inf reaches the tokens or the JSON.

A repetition penalty of 1e-300 rounds to 0 in float32 (logit / 0 = inf, then inf - inf = NaN) and
1e39 rounds to inf (0 * inf = NaN); the sampler clamps the penalty, and the server's logprob
shapes send -inf / NaN as vLLM's -9999.0.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ferrylm.model.sampler import Sampler, SamplingBatch, SamplingRequestState, apply_penalties_and_bias
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.logprobs import chat_logprobs, completion_logprobs

CPU = torch.device("cpu")
VOCAB = 512
PROMPT = list(range(0, VOCAB, 3))  # every third token is "seen"
PENALTIES = [5e-324, 1e-300, 1e-40, 1e-39, 1e39, 1e300]


def states(repetition_penalty: float, rows: int = 6, **kw) -> list[SamplingRequestState]:
    """Greedy, unseeded and seeded rows, all asking for logprobs."""
    temps = [0.0, 1.0, 0.7]
    return [SamplingRequestState(SamplingParams(repetition_penalty=repetition_penalty, logprobs=5,
                                                temperature=temps[i % 3], seed=i if i % 3 == 2 else None, **kw),
                                 list(PROMPT), [1, 2]) for i in range(rows)]


def extreme_logits(rows: int) -> torch.Tensor:
    """Random logits with exact zeros on some seen tokens (0 * inf = NaN before the fix)."""
    torch.manual_seed(21)
    logits = torch.randn(rows, VOCAB) * 4
    logits[:, PROMPT[::5]] = 0.0
    return logits


@pytest.mark.parametrize("penalty", PENALTIES)
def test_extreme_repetition_penalty_gives_finite_processed_logits(penalty: float) -> None:
    batch = SamplingBatch.build(states(penalty), VOCAB, [], CPU)
    processed = apply_penalties_and_bias(extreme_logits(6), batch)
    assert torch.isfinite(processed).all()


@pytest.mark.parametrize("penalty", PENALTIES)
def test_extreme_repetition_penalty_gives_finite_logprobs_and_sane_tokens(penalty: float) -> None:
    logits = extreme_logits(6)
    batch = SamplingBatch.build(states(penalty), VOCAB, [], CPU)
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert ((out.token_ids >= 0) & (out.token_ids < VOCAB)).all()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()
    processed = apply_penalties_and_bias(logits, batch)
    chosen = processed.gather(1, out.token_ids[:, None]).squeeze(1)
    assert torch.isfinite(chosen).all()
    if penalty < 1.0:
        # A vanishing penalty divides seen positive logits into the 1e30s: the best of those is
        # (numerically) certain, for greedy and sampled rows alike.
        assert torch.equal(out.token_ids, processed.argmax(-1))
        assert set(out.token_ids.tolist()) <= set(PROMPT)
        torch.testing.assert_close(out.logprobs, torch.zeros(6), rtol=0, atol=1e-6)
    else:
        greedy = out.token_ids[0::3]
        assert torch.equal(greedy, processed[0::3].argmax(-1))


def test_extreme_penalty_with_min_tokens_never_emits_banned_token() -> None:
    # min_tokens sets EOS to -inf before the penalty: -inf * penalty must stay -inf, never NaN.
    logits = extreme_logits(6)
    logits[:, 3] = 50.0  # EOS (a seen token) would win
    for penalty in (1e-300, 1e39):
        sts = states(penalty, min_tokens=4)
        out = Sampler()(logits, SamplingBatch.build(sts, VOCAB, [3], CPU))
        assert 3 not in out.token_ids.tolist()
        assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("temperature", [1e30, 1e39, 1e300])
def test_huge_temperature_never_samples_a_masked_token(temperature: float) -> None:
    # float32(1e39) is inf and -inf / inf is NaN: a banned token could then win the race.
    torch.manual_seed(22)
    logits = torch.randn(64, 40)
    sts = [SamplingRequestState(SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=[5, 6, 7],
                                               seed=i if i % 2 else None), [1], []) for i in range(64)]
    out = Sampler()(logits, SamplingBatch.build(sts, 40, [0], CPU))
    assert not set(out.token_ids.tolist()) & {0, 5, 6, 7}


@pytest.mark.parametrize("min_p", [5e-324, 1e-300, 1e-45])
def test_tiny_min_p_keeps_everything_finite(min_p: float) -> None:
    torch.manual_seed(23)
    logits = torch.randn(16, 100)
    sts = [SamplingRequestState(SamplingParams(temperature=1.0, min_p=min_p, logprobs=2), [1], []) for _ in range(16)]
    out = Sampler()(logits, SamplingBatch.build(sts, 100, [], CPU))
    assert ((out.token_ids >= 0) & (out.token_ids < 100)).all() and torch.isfinite(out.logprobs).all()


# ---------------------------------------------------------------- JSON shapes


class _Tokenizer:
    """Just enough of Tokenizer for the logprob shapes: one printable piece per id."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


BAD_ENTRIES = [{7: float("-inf"), 1: -0.5, 2: float("nan"), 3: float("-inf")},
               {8: float("nan"), 1: float("-inf"), 4: -1e30},
               {9: -0.25, 5: float("inf")}]


def test_chat_logprobs_are_always_finite_json() -> None:
    lp = chat_logprobs(_Tokenizer(), [7, 8, 9], BAD_ENTRIES, 3)
    json.dumps(lp.model_dump(), allow_nan=False)  # what JSONResponse does: raised before the fix
    assert "null" not in lp.model_dump_json()  # what the SSE path writes: null before the fix
    first = lp.content[0]
    assert first.logprob == -9999.0
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("<1>", -0.5), ("<7>", -9999.0),
                                                                  ("<2>", -9999.0)]
    assert lp.content[1].logprob == -9999.0 and lp.content[2].top_logprobs[0].logprob == 0.0
    for token in lp.content:
        assert all(math.isfinite(t.logprob) for t in [token, *token.top_logprobs])


def test_completion_logprobs_are_always_finite_json() -> None:
    lp = completion_logprobs(_Tokenizer(), [7, 8, 9], BAD_ENTRIES, 2, offset=0)
    json.dumps(lp.model_dump(), allow_nan=False)
    assert "null" not in lp.model_dump_json()
    assert lp.token_logprobs == [-9999.0, -9999.0, -0.25]
    assert lp.top_logprobs[0] == {"<1>": -0.5, "<7>": -9999.0}
    assert lp.top_logprobs[1] == {"<8>": -9999.0, "<1>": -9999.0}  # ties keep the engine order


def test_ordinary_logprobs_are_unchanged() -> None:
    entries = [{4: -0.125, 6: -2.5, 2: -0.0625}]
    lp = completion_logprobs(_Tokenizer(), [4], entries, 3, offset=5)
    assert lp.token_logprobs == [-0.125] and lp.text_offset == [5]
    assert lp.top_logprobs == [{"<2>": -0.0625, "<4>": -0.125, "<6>": -2.5}]
