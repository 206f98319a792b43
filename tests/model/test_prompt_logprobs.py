"""Prompt logprobs (SamplingParams.prompt_logprobs) from the prefill pass, against transformers on the
same GGUF in float32: every position's logprob, rank and top alternatives, with batching and chunked
prefill; a prefix-cache hit does not lose them (such a request computes its whole prompt); max_tokens=0
ends after the prompt with no token and no leaked block."""

from __future__ import annotations

import pytest
import torch

from ferrylm import SamplingParams
from tests.conftest import engine_like, requires_smollm2

pytestmark = requires_smollm2

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "def add(a, b):\n    return a + b\n",
         "Once upon a time there was a little fox who lived in the forest near a river. Every morning "
         "the fox walked to the water to drink, and every evening it came back home to sleep."]
TOL = 2e-3  # float32 both sides; different kernels and summation orders


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]


def _check(prompt_logprobs, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entries, row, token = prompt_logprobs[p], ref[p - 1], ids[p]
        assert next(iter(entries)) == token  # the prompt's own token first
        assert abs(entries[token].logprob - row[token].item()) < TOL, (p, entries[token], row[token].item())
        surely_above, maybe_above = int((row > row[token] + TOL).sum()), int((row > row[token] - TOL).sum())
        assert surely_above + 1 <= entries[token].rank <= maybe_above + 1, (p, entries[token].rank)
        top = sorted(entries.items(), key=lambda e: -e[1].logprob)[:k]
        want = torch.topk(row, k).values
        assert len(top) == k and all(abs(lp.logprob - w) < TOL for (_, lp), w in zip(top, want.tolist()))
        assert all(abs(lp.logprob - row[tid].item()) < TOL and lp.decoded_token is not None
                   for tid, lp in entries.items())


def test_prompt_logprobs_match_transformers_batched(llm_fp32, hf_reference):
    tok = llm_fp32.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    outs = llm_fp32.generate([{"prompt_token_ids": ids} for ids in prompts],
                             SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        _check(out.prompt_logprobs, ids, _reference(hf_reference, ids), k=3)
        assert len(out.outputs[0].token_ids) == 2


def test_chunked_prefill_and_a_prefix_hit_keep_every_position(llm_fp32, hf_reference):
    """A 16-token budget splits each prompt into chunks; a request that would hit the prefix cache
    computes its whole prompt instead (num_cached_tokens 0), while a plain one still hits."""
    engine = engine_like(llm_fp32, max_num_batched_tokens=16, enable_prefix_caching=True)
    ids = llm_fp32.get_tokenizer().encode(TEXTS[2])
    plain = SamplingParams(max_tokens=1, temperature=0)
    engine.add_request("warm", ids, plain)
    outs = _drain(engine)
    engine.add_request("scored", ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    engine.add_request("hit", ids, plain)
    outs |= _drain(engine)
    assert outs["scored"].num_cached_tokens == 0 and outs["hit"].num_cached_tokens > 0
    assert outs["hit"].prompt_logprobs is None
    _check(outs["scored"].prompt_logprobs, ids, _reference(hf_reference, ids), k=1)


def test_max_tokens_zero_scores_the_prompt_and_ends(llm_fp32):
    engine = engine_like(llm_fp32, max_num_batched_tokens=16)
    ids = llm_fp32.get_tokenizer().encode(TEXTS[0])
    engine.add_request("zero", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    outs = _drain(engine, check=True)
    out = outs["zero"]
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason.value == "length"
    assert len(out.prompt_logprobs) == len(ids) and all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert not engine.block_manager.tables  # no request holds blocks


def test_n_samples_score_the_prompt_once(llm_fp32, hf_reference):
    """n > 1 with prompt logprobs (lm-evaluation-harness's echo scoring with n, or a hostile fan-out):
    one sample computes and scores the prompt, the others take its cached blocks, and every
    choice carries the same prompt logprobs."""
    engine = engine_like(llm_fp32, max_num_batched_tokens=16, enable_prefix_caching=True)
    llm = type(llm_fp32).from_engine(engine)
    ids = llm_fp32.get_tokenizer().encode(TEXTS[2])
    hits = engine.scheduler.prefix_cache_hits
    [out] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=4, max_tokens=0, prompt_logprobs=2, seed=0),
                         use_tqdm=False)
    _check(out.prompt_logprobs, ids, _reference(hf_reference, ids), k=2)
    full = (len(ids) - 1) // 16 * 16  # full blocks of the prompt but the last token's
    assert engine.scheduler.prefix_cache_hits - hits >= 3 * full  # three samples computed almost nothing
    assert len(out.outputs) == 4 and all(c.token_ids == [] for c in out.outputs)


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_prompt_logprobs_out_of_range_is_refused(value):
    from ferrylm.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(prompt_logprobs=value)
    assert err.value.param == "prompt_logprobs"


def _drain(engine, check: bool = False) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.scheduler.check_invariants()
    return done


def test_max_tokens_zero_with_the_default_dtype_and_packed_gguf():
    """The served default (bf16 where the CPU has it, GGUF blocks kept packed): a scoring request
    samples no row, so the LM head runs on 0 rows (it used to crash the VNNI kernel)."""
    from ferrylm import LLM

    llm = LLM("smollm2-135m", enforce_eager=True, max_num_seqs=2, kv_cache_memory=64 << 20)
    ids = llm.get_tokenizer().encode("The sky is")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and len(out.prompt_logprobs) == len(ids)
