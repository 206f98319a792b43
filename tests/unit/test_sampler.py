"""Acceptance tests for ferrylm.model.sampler (batched sampler, vLLM/OpenAI semantics)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.model.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRequestState,
    apply_penalties_and_bias,
    greedy_ids,
    plain_greedy,
)
from ferrylm.sampling_params import SamplingParams
from tests.conftest import examples

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def state(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingRequestState:
    return SamplingRequestState(SamplingParams(**kw), list(prompt or [0]), list(output or []))


def build(states: list[SamplingRequestState], vocab: int, eos: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch.build(states, vocab, eos if eos is not None else [], CPU)


def sample(logits: torch.Tensor, states: list[SamplingRequestState], eos: list[int] | None = None):
    return Sampler()(logits, build(states, logits.shape[1], eos))


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(16, 5000) * 3).to(dtype)
    batch = build([state(temperature=0.0) for _ in range(16)], 5000)
    assert batch.plain_greedy
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.zeros(3, 10)
    logits[0, [2, 7]] = 5.0
    logits[1, [9, 4, 6]] = 1.0
    out = sample(logits, [state(temperature=0.0) for _ in range(3)])
    assert out.token_ids.tolist() == [2, 4, 0]


def test_greedy_does_not_touch_global_rng() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    before = torch.get_rng_state()
    sample(logits, [state(temperature=0.0, seed=3, repetition_penalty=1.3) for _ in range(4)])
    assert torch.equal(before, torch.get_rng_state())


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    torch.manual_seed(2)
    vocab = 2000
    logits = torch.randn(12, vocab)  # flat: a sampled row almost never lands on argmax
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.0, top_p=0.5, top_k=3, seed=5),  # sampling knobs ignored when greedy
        dict(temperature=1.3, top_p=0.9),
        dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, logit_bias={7: 3.0}),
        dict(temperature=0.8, top_k=50, seed=11),
    ] * 2
    states = [state(prompt=[1, 2, 3], output=[4, 4, 5], **k) for k in kinds]
    batch = build(states, vocab)
    expected = apply_penalties_and_bias(logits, batch).argmax(-1)
    greedy_rows = [i for i, k in enumerate(kinds) if k["temperature"] == 0.0]
    sampled_rows = [i for i, k in enumerate(kinds) if k["temperature"] > 0.0]
    matches_on_sampled = 0
    for _ in range(20):
        out = Sampler()(logits, batch).token_ids
        assert torch.equal(out[greedy_rows], expected[greedy_rows])
        matches_on_sampled += int((out[sampled_rows] == expected[sampled_rows]).sum())
    assert matches_on_sampled < 20  # sampled rows really do sample


def test_all_greedy_with_penalties_is_argmax_of_processed() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, 300)
    states = [state(prompt=[i], output=[i + 1, i + 1], temperature=0.0, frequency_penalty=2.0)
              for i in range(6)]
    batch = build(states, 300)
    assert batch.all_greedy and not batch.plain_greedy
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, apply_penalties_and_bias(logits, batch).argmax(-1))


# ---------------------------------------------------------------- seeds


VOCAB_SEED = 512
FAKE_MODEL_TABLE = torch.randn(VOCAB_SEED, VOCAB_SEED, generator=torch.Generator().manual_seed(1234)) * 2


def fake_model_logits(states: list[SamplingRequestState]) -> torch.Tensor:
    """Deterministic logits per request: a function of its last token only."""
    last = [(s.output_token_ids or s.prompt_token_ids)[-1] for s in states]
    return FAKE_MODEL_TABLE[last]


def run_steps(target: SamplingRequestState, filler_plan: list[list[str]], steps: int) -> list[int]:
    """Run `target` for `steps` steps; each step builds a fresh batch from filler_plan[step % len]."""
    rng = np.random.default_rng(len(filler_plan))
    for step in range(steps):
        layout = filler_plan[step % len(filler_plan)]
        rows = []
        for slot in layout:
            if slot == "T":
                rows.append(target)
            else:
                p = {"u": dict(temperature=1.0),
                     "s": dict(temperature=0.7, seed=int(rng.integers(1 << 30)), top_p=0.8),
                     "g": dict(temperature=0.0),
                     "k": dict(temperature=1.5, top_k=5, min_p=0.1)}[slot]
                rows.append(state(prompt=[int(rng.integers(VOCAB_SEED))], **p))
        out = sample(fake_model_logits(rows), rows, eos=[0]).token_ids
        target.output_token_ids.append(int(out[layout.index("T")]))
    return target.output_token_ids


SEEDED_PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.2, top_k=20, min_p=0.02),
    dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
         logit_bias={5: 2.0}),
    dict(temperature=0.9, top_k=40, top_p=0.95, min_tokens=5),
]
LAYOUTS = [
    [["T"]],
    [["u", "T", "s"], ["T", "u", "u", "g", "s", "k"], ["g", "g", "T"]],
    [["s", "s", "s", "s", "T", "u"], ["k", "T"], ["T"], ["u"] * 9 + ["T"]],
]


@pytest.mark.parametrize("params", SEEDED_PARAMS)
def test_seeded_request_is_reproducible_across_batches(params: dict) -> None:
    runs = []
    for i, layout in enumerate(LAYOUTS):
        torch.manual_seed(100 + i)  # unseeded neighbours differ between runs
        runs.append(run_steps(state(prompt=[3, 9], seed=42, **params), layout, 20))
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 3  # the request really samples
    other_seed = run_steps(state(prompt=[3, 9], seed=43, **params), LAYOUTS[1], 20)
    assert other_seed != runs[0]


def test_unseeded_requests_do_vary() -> None:
    torch.manual_seed(7)
    runs = [run_steps(state(prompt=[3, 9], temperature=1.0), [["T"]], 20) for _ in range(2)]
    assert runs[0] != runs[1]


def test_seeded_batch_does_not_consume_global_rng_unless_needed() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, 100)
    before = torch.get_rng_state()
    sample(logits, [state(seed=i, temperature=1.0) for i in range(3)])
    assert torch.equal(before, torch.get_rng_state())


# ---------------------------------------------------------------- truncation


def reference_allowed(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float, min_p: float):
    """Independent numpy reference: renormalised probabilities after top_k -> top_p -> min_p."""
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    k = len(probs) if top_k is None else top_k
    keep[order[:k]] = True
    kept_probs = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    cum = np.cumsum(kept_probs[order])
    n_top_p = int(np.searchsorted(cum, top_p - 1e-9)) + 1  # smallest prefix with mass >= p
    keep_p = np.zeros_like(keep)
    keep_p[order[:n_top_p]] = True
    keep &= keep_p
    keep &= probs >= min_p * probs.max()
    final = np.where(keep, probs, 0.0)
    return keep, final / final.sum()


TRUNCATION_CASES = [
    dict(temperature=1.0, top_k=4),
    dict(temperature=0.8, top_k=7),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=2.0, top_p=0.75),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.5, min_p=0.05),
    dict(temperature=1.2, top_k=8, top_p=0.7),
    dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.15),
]
# Distinct values with clear gaps so no threshold sits on a rounding boundary.
FIXED_LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.1, 1.2, -3.0, 2.6, 0.0, 1.7, -0.4,
                             0.9, 2.2, -2.0, 1.45, 0.25, -0.8, 2.9, -5.0, 0.7, 1.95])


def check_frequencies(tokens: torch.Tensor, case: dict) -> None:
    allowed, probs = reference_allowed(FIXED_LOGITS.double().numpy(), case["temperature"], case.get("top_k"),
                                       case.get("top_p", 1.0), case.get("min_p", 0.0))
    assert 1 < allowed.sum() < len(allowed), "case must actually truncate"
    emitted = set(tokens.tolist())
    assert emitted == set(np.flatnonzero(allowed).tolist()), case
    freq = np.bincount(tokens.numpy(), minlength=len(allowed)) / len(tokens)
    np.testing.assert_allclose(freq, probs, atol=0.02, err_msg=str(case))


@pytest.mark.parametrize("case", TRUNCATION_CASES)
def test_truncation_emits_only_allowed_tokens_with_right_frequencies(case: dict) -> None:
    torch.manual_seed(9)
    draws = 20000
    logits = FIXED_LOGITS.expand(draws, -1).clone()
    tokens = sample(logits, [state(**case) for _ in range(draws)]).token_ids
    check_frequencies(tokens, case)


def test_truncation_mixed_batch_uses_each_rows_own_parameters() -> None:
    torch.manual_seed(10)
    per_case = 20000
    states, logits = [], FIXED_LOGITS.expand(per_case * len(TRUNCATION_CASES), -1).clone()
    for case in TRUNCATION_CASES:
        states += [state(**case) for _ in range(per_case)]
    tokens = sample(logits, states).token_ids
    for i, case in enumerate(TRUNCATION_CASES):
        check_frequencies(tokens[i * per_case:(i + 1) * per_case], case)


def test_untruncated_sampling_matches_softmax() -> None:
    torch.manual_seed(11)
    case = dict(temperature=1.5)
    probs = torch.softmax(FIXED_LOGITS.double() / 1.5, -1).numpy()
    tokens = sample(FIXED_LOGITS.expand(20000, -1).clone(), [state(**case) for _ in range(20000)]).token_ids
    np.testing.assert_allclose(np.bincount(tokens.numpy(), minlength=20) / 20000, probs, atol=0.02)


def test_top_k_alone_never_sorts_the_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args, **kwargs):
        raise AssertionError("full-vocab sort used without top_p")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    monkeypatch.setattr(torch, "sort", no_sort)
    torch.manual_seed(12)
    states = [state(temperature=1.0, top_k=3), state(temperature=0.9), state(temperature=0.0), state(top_k=1)]
    logits = torch.randn(4, 1000)
    out = sample(logits, states)
    top3 = logits[0].topk(3).indices.tolist()
    assert int(out.token_ids[0]) in top3
    assert int(out.token_ids[3]) == int(logits[3].argmax())


def test_no_truncation_work_when_no_row_needs_it() -> None:
    batch = build([state(temperature=0.7), state(temperature=0.0, top_k=3, top_p=0.5, min_p=0.5)], 100)
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    batch = build([state(temperature=1.0, top_k=1000)], 100)  # top_k >= vocab is a no-op
    assert batch.top_k is None


# ---------------------------------------------------------------- penalties and bias

BASE = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0]


def processed_row(**kw) -> list[float]:
    prompt, output = kw.pop("prompt", [6]), kw.pop("output", [])
    neutral = state(prompt=[1, 2], output=[1, 1])
    logits = torch.tensor([BASE, BASE])
    before = logits.clone()
    out = apply_penalties_and_bias(logits, build([state(prompt=prompt, output=output, **kw), neutral], 8))
    assert torch.equal(logits, before), "input logits must not be modified"
    assert out.dtype == torch.float32 and out[1].tolist() == BASE, "a row without penalties is untouched"
    return out[0].tolist()


def test_repetition_penalty_on_prompt_and_output_tokens() -> None:
    # prompt {0, 1, 7}, output {2, 3, 3}; positive logits divided, negative multiplied, zero stays zero.
    row = processed_row(prompt=[0, 1, 7], output=[2, 3, 3], repetition_penalty=2.0)
    assert row == [1.0, -4.0, 0.5, -2.0, 0.5, 3.0, -0.5, 0.0]
    row = processed_row(prompt=[5, 6], output=[0], repetition_penalty=0.5)  # < 1 rewards repeats
    assert row == [4.0, -2.0, 1.0, -1.0, 0.5, 6.0, -0.25, 0.0]


def test_frequency_and_presence_use_output_counts_only() -> None:
    row = processed_row(prompt=[4, 4, 4], output=[2, 2, 5], frequency_penalty=0.5)
    assert row == [2.0, -2.0, 0.0, -1.0, 0.5, 2.5, -0.5, 0.0]
    row = processed_row(prompt=[4, 4, 4], output=[2, 2, 5], presence_penalty=0.25)
    assert row == [2.0, -2.0, 0.75, -1.0, 0.5, 2.75, -0.5, 0.0]
    row = processed_row(output=[1, 1, 0], frequency_penalty=-1.0, presence_penalty=-0.5)
    assert row == [3.5, 0.5, 1.0, -1.0, 0.5, 3.0, -0.5, 0.0]


def test_logit_bias_is_added_to_raw_logits() -> None:
    row = processed_row(logit_bias={1: 5.0, 6: -100.0, 7: 0.25})
    assert row == [2.0, 3.0, 1.0, -1.0, 0.5, 3.0, -100.5, 0.25]


def test_processing_order_bias_then_repetition_then_frequency() -> None:
    # token 0: (2 - 1) / 2 = 0.5 (not 2/2 - 1 = 0); token 5 seen twice: 3/2 - 2*0.5 - 0.25 = 0.25.
    row = processed_row(prompt=[0], output=[5, 5], logit_bias={0: -1.0}, repetition_penalty=2.0,
                        frequency_penalty=0.5, presence_penalty=0.25)
    assert row == [0.5, -2.0, 1.0, -1.0, 0.5, 0.25, -0.5, 0.0]


def test_logit_bias_outside_vocab_is_skipped_not_raised() -> None:
    # Engine.add_request rejects such ids; the sampler runs inside Engine.step, where raising would
    # kill the engine loop, so it ignores them (the in-vocab entry still applies).
    batch = build([state(logit_bias={8: 1.0, -1: 2.0, 3: 0.5})], 8)
    rows, cols, values = batch.logit_bias
    assert rows.tolist() == [0] and cols.tolist() == [3] and values.tolist() == [0.5]
    assert build([state(logit_bias={8: 1.0})], 8).logit_bias is None


def test_penalties_on_bfloat16_logits_work_in_float32() -> None:
    logits = torch.tensor([BASE], dtype=torch.bfloat16)
    out = apply_penalties_and_bias(logits, build([state(output=[0], frequency_penalty=0.25)], 8))
    assert out.dtype == torch.float32 and out[0, 0].item() == 1.75


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 7] = 10.0  # EOS dominates
    logits[0, 5] = 9.0  # stop token next
    for produced in range(5):
        kw = dict(prompt=[1], output=[2] * produced, temperature=0.0, min_tokens=3, stop_token_ids=[5])
        s = state(**kw)
        batch = build([s], 8, eos=[7, 6])
        row = apply_penalties_and_bias(logits, batch)[0]
        token = int(Sampler()(logits, batch).token_ids[0])
        if produced < 3:
            assert row[5] == NEG_INF and row[6] == NEG_INF and row[7] == NEG_INF
            assert token == 0 and torch.isfinite(row[:5]).all()
        else:
            assert batch.min_tokens_mask is None and torch.equal(row, logits[0]) and token == 7


def test_min_tokens_with_ignore_eos_keeps_eos_but_masks_stop_ids() -> None:
    logits = torch.zeros(2, 8)
    s = state(output=[1], min_tokens=4, ignore_eos=True, stop_token_ids=[3, 99])  # 99: outside vocab
    row = apply_penalties_and_bias(logits, build([s, state(output=[1], min_tokens=1)], 8, eos=[7]))
    assert row[0].tolist() == [0.0, 0.0, 0.0, NEG_INF, 0.0, 0.0, 0.0, 0.0]
    assert row[1].tolist() == [0.0] * 8  # second row already reached min_tokens


def test_min_tokens_sampled_rows_never_emit_banned_tokens() -> None:
    torch.manual_seed(13)
    logits = torch.zeros(4000, 8)
    states = [state(output=[], min_tokens=2, stop_token_ids=[1], temperature=1.0) for _ in range(4000)]
    tokens = set(sample(logits, states, eos=[0]).token_ids.tolist())
    assert tokens == {2, 3, 4, 5, 6, 7}


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_processed_pre_temperature_distribution() -> None:
    torch.manual_seed(14)
    vocab = 1000
    logits = torch.randn(5, vocab) * 2
    states = [
        state(logprobs=3, temperature=0.5, top_k=10, top_p=0.9),
        state(temperature=1.0),  # did not ask: values still valid
        state(logprobs=5, temperature=0.0, output=[4, 4], frequency_penalty=1.0, logit_bias={9: 20.0}),
        state(logprobs=0, temperature=2.0, min_p=0.1, seed=1),
        state(logprobs=1, temperature=1.0, repetition_penalty=1.7, prompt=[1, 2, 3]),
    ]
    batch = build(states, vocab)
    out = Sampler()(logits, batch)
    expected = torch.log_softmax(apply_penalties_and_bias(logits, batch), dim=-1)
    assert out.top_logprob_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    assert out.logprobs.dtype == torch.float32 and out.top_logprob_ids.dtype == torch.int64
    chosen = expected.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen, rtol=0, atol=0)
    torch.testing.assert_close(out.top_logprobs, expected.gather(1, out.top_logprob_ids), rtol=0, atol=0)
    assert torch.equal(out.top_logprob_ids, expected.topk(5, dim=-1).indices)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()
    assert out.top_logprob_ids[2, 0] == 9  # bias shows up in the logprobs


def test_logprobs_zero_only_chosen_and_none_when_not_asked() -> None:
    logits = torch.randn(2, 50)
    out = sample(logits, [state(temperature=0.0, logprobs=0), state(temperature=0.0)])
    assert out.top_logprob_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    out = sample(logits, [state(temperature=1.0), state(temperature=0.0)])
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_greedy_fast_path_logprobs_from_bfloat16() -> None:
    logits = torch.randn(3, 64).to(torch.bfloat16)
    out = sample(logits, [state(temperature=0.0, logprobs=2) for _ in range(3)])
    expected = torch.log_softmax(logits.float(), -1)
    assert torch.equal(out.top_logprob_ids, expected.topk(2).indices)
    torch.testing.assert_close(out.logprobs, expected.max(-1).values, rtol=0, atol=0)


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("temperature", [1e-5, 1e-12, 1e-38, 1e-60])
@pytest.mark.parametrize("scale", [1.0, 1e3, 1e30])
def test_tiny_temperature_is_finite_and_argmax(temperature: float, scale: float) -> None:
    torch.manual_seed(15)
    logits = torch.randn(32, 4096) * scale
    states = [state(temperature=temperature, top_p=0.9 if i % 2 else 1.0, seed=i if i % 3 else None,
                    min_p=0.1 if i % 5 == 0 else 0.0) for i in range(32)]
    out = sample(logits, states)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-9, 1e-3])
def test_tiny_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    # 1 - 1e-9 rounds to 1.0 in float32: the best token must still survive the cumulative cut.
    torch.manual_seed(16)
    logits = torch.randn(64, 3000)
    states = [state(temperature=1.0, top_p=top_p, top_k=None if i % 2 else 100) for i in range(64)]
    assert torch.equal(sample(logits, states).token_ids, logits.argmax(-1))


def test_degenerate_zero_uniform_draws_pick_best_allowed_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # U = 0 has probability ~2**-24 per draw; it must not yield NaN or a masked token.
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: self.fill_(0.0))
    torch.manual_seed(17)
    logits = torch.randn(8, 300)
    states = [state(temperature=0.9, top_k=5 if i % 2 else None, seed=i if i < 4 else None) for i in range(8)]
    assert torch.equal(sample(logits, states).token_ids, logits.argmax(-1))


def test_all_masked_but_one_is_forced() -> None:
    logits = torch.full((200, 16), -1e4)
    logits[:, 11] = 0.0
    states = [state(temperature=1.0, logit_bias={3: 100.0}, min_tokens=1, stop_token_ids=[3])
              for _ in range(200)]
    assert set(sample(logits, states).token_ids.tolist()) == {11}


def test_empty_batch() -> None:
    out = sample(torch.empty(0, 10), [])
    assert out.token_ids.shape == (0,)


def test_wrong_logits_shape_is_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), build([state()], 10))


@settings(max_examples=examples(60), deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    vocab=st.integers(2, 60),
)
def test_property_sampled_token_is_allowed(data: st.DataObject, rows: int, vocab: int) -> None:
    torch.manual_seed(data.draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab) * data.draw(st.sampled_from([0.1, 1.0, 10.0]))
    states = []
    for _ in range(rows):
        states.append(state(
            temperature=data.draw(st.sampled_from([0.0, 1e-6, 0.3, 1.0, 3.0])),
            top_k=data.draw(st.one_of(st.none(), st.integers(1, vocab + 3))),
            top_p=data.draw(st.sampled_from([1.0, 0.95, 0.5, 1e-3])),
            min_p=data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
            seed=data.draw(st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1))),
            logprobs=data.draw(st.one_of(st.none(), st.integers(0, 20))),
        ))
    batch = build(states, vocab)
    out = Sampler()(logits, batch)
    processed = apply_penalties_and_bias(logits, batch)
    for i, s in enumerate(states):
        token = int(out.token_ids[i])
        p = s.params
        if p.greedy:
            assert token == int(processed[i].argmax())
            continue
        rank = int((processed[i] > processed[i, token]).sum())  # tokens strictly better
        assert p.top_k is None or rank < p.top_k
        probs = torch.softmax(processed[i].double() / p.temperature, -1)
        assert probs[token] >= p.min_p * probs.max() * (1 - 1e-4)
        assert probs[probs > probs[token] * (1 + 1e-4)].sum() < p.top_p + 1e-4
    if out.logprobs is not None:
        assert torch.isfinite(out.logprobs).all()
        k = max(s.params.logprobs for s in states if s.params.logprobs is not None)
        assert out.top_logprobs.shape == (rows, min(k, vocab))


# ---------------------------------------------------------------- the runner's argmax-only fast path


@pytest.mark.parametrize("change", [
    {}, {"temperature": 0.7}, {"logit_bias": {3: 5.0}}, {"logprobs": 2}, {"repetition_penalty": 1.2},
    {"frequency_penalty": 0.5}, {"presence_penalty": -0.5}, {"min_tokens": 4}, {"min_tokens": 1},
])
def test_plain_greedy_is_exactly_when_the_built_batch_is_plain_greedy_without_logprobs(change) -> None:
    """The runner skips SamplingBatch.build when plain_greedy(states): that must hold only where the built
    batch would take the raw argmax and return no logprobs, for every field that changes a greedy row."""
    params = {"temperature": 0.0, "stop_token_ids": [5], **change}
    states = [state(output=[1], temperature=0.0), state(output=[2], **params)]
    batch = build(states, 16, eos=[4])
    assert plain_greedy(states) == (batch.plain_greedy and batch.max_num_logprobs is None)
    if plain_greedy(states):
        logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
        assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(dim=-1))


def test_greedy_ids_equal_torch_argmax_ties_nan_and_inf_included() -> None:
    """greedy_ids (numpy's argmax on float32 CPU logits) picks what torch.argmax picks: the first maximum,
    a NaN as the maximum, an all -inf row's first index; strided views and other dtypes too."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen)
    logits[1, [10, 700]] = 9.0  # a tie: the first
    logits[2, [30, 40]] = float("nan")  # NaN counts as the maximum, the first one
    logits[3] = float("-inf")
    logits[4, 5] = float("inf")
    logits[5, :] = 0.0
    for x in (logits, logits[:, ::2], logits[::2], logits[:0], logits.bfloat16(), logits.half()):
        got = greedy_ids(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), x.dtype
