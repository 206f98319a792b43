"""Speculative decoding in the engine (n-gram drafts scheduled in the token budget, verified in one
forward): greedy output is token for token that of plain decoding on SmolLM2 with chunked prefill,
a prefix hit, preemption, stop strings, max_tokens and aborts, with the block accounting checked after
every step; sampled output keeps the target's distribution (a tiny random model, chi-square)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ferrylm import SamplingParams
from ferrylm.config import CacheConfig, SpeculativeConfig
from tests.conftest import chat_prompt_ids, engine_like, requires_smollm2, run_to_completion
from tests.model.prompts import SIXTEEN_PROMPTS

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=4, disable_by_batch_size=64)
GROUNDED = [  # the answer repeats text of the prompt: what prompt lookup is for
    "Repeat this list exactly, once: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
    "Copy this code without changes:\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n",
    "Count from 1 to 30, separated by commas.",
    "Rewrite this table as CSV:\n| name | age |\n| Ann | 31 |\n| Bob | 42 |\n| Cy | 27 |",
]


@contextlib.contextmanager
def speculating(llm, config: SpeculativeConfig = NGRAM):
    """The shared runner proposes drafts inside the block (the runner is shared by the model tests)."""
    runner = llm.engine.executor
    runner.set_speculative(config)
    try:
        yield
    finally:
        runner.set_speculative(None)


@pytest.fixture(scope="module")
def prompts(llm_fp32):
    return chat_prompt_ids(llm_fp32, GROUNDED + SIXTEEN_PROMPTS[:6])


def _run(llm, prompts, params, check=True, **overrides):
    engine = engine_like(llm, **overrides)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params[i] if isinstance(params, list) else params)
    done = run_to_completion(engine, check=check)
    return [done[str(i)] for i in range(len(prompts))], engine


@requires_smollm2
def test_greedy_with_ngram_drafts_equals_plain_decoding(llm_fp32, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # A long shared prefix: the second request of the pair is admitted on a prefix hit.
    shared = prompts[1] * 3
    batch = prompts + [shared + [28], shared + [29]]
    plain, _ = _run(llm_fp32, batch, params, max_num_batched_tokens=64)
    with speculating(llm_fp32):
        spec, engine = _run(llm_fp32, batch, params, max_num_batched_tokens=64)
    assert spec == plain
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 100, stats  # drafts were really taken
    assert stats.prefix_cache_hits > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@requires_smollm2
def test_speculation_under_preemption_keeps_greedy_output(llm_fp32, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(llm_fp32, prompts, params)
    with speculating(llm_fp32):
        spec, engine = _run(llm_fp32, prompts, params, num_blocks=24, max_num_batched_tokens=128)
    assert engine.scheduler.num_preemptions > 0
    assert spec == plain


@requires_smollm2
def test_stop_strings_max_tokens_eos_and_abort_with_drafts(llm_fp32, prompts):
    """Nothing past a stop string, a stop token, EOS or max_tokens is emitted, even when a draft
    accepted in one step runs past it; an abort frees every block."""
    variants = [SamplingParams(temperature=0.0, max_tokens=7), SamplingParams(temperature=0.0, max_tokens=40),
                SamplingParams(temperature=0.0, max_tokens=40, stop=["date", "cherry,"]),
                SamplingParams(temperature=0.0, max_tokens=40, stop=[" * b"]),
                SamplingParams(temperature=0.0, max_tokens=40, stop=["10,"], include_stop_str_in_output=True)]
    batch = [prompts[0], prompts[0], prompts[0], prompts[1], prompts[2]]
    params = variants

    def texts(spec: bool):
        with speculating(llm_fp32) if spec else contextlib.nullcontext():
            engine = engine_like(llm_fp32)
            outs = {}
            for i, (ids, p) in enumerate(zip(batch, params)):
                engine.add_request(str(i), ids, p)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        c = out.outputs[0]
                        outs[out.request_id] = (c.text, c.token_ids, c.finish_reason, c.stop_reason)
                engine.scheduler.check_invariants()
            return [outs[str(i)] for i in range(len(batch))], engine

    plain, _ = texts(False)
    spec, engine = texts(True)
    assert spec == plain
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert len(spec[0][1]) == 7

    with speculating(llm_fp32):
        engine = engine_like(llm_fp32)
        for i, ids in enumerate(prompts[:4]):
            engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        for _ in range(12):
            engine.step()
        assert engine.stats().spec_decode_num_drafts > 0
        for i in range(4):
            engine.abort(str(i))
        engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@requires_smollm2
def test_seeded_sampling_with_drafts_is_reproducible(llm_fp32, prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=32) for s in range(4)]
    with speculating(llm_fp32):
        first, engine = _run(llm_fp32, prompts[:4], params)
        again, _ = _run(llm_fp32, prompts[:4], params)
    assert first == again
    assert engine.stats().spec_decode_num_drafts > 0
    # n > 1: the children of one request speculate independently and stay reproducible
    from ferrylm import LLM

    n3 = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=24)
    with speculating(llm_fp32):
        outs = [LLM.from_engine(engine_like(llm_fp32)).generate([{"prompt_token_ids": prompts[3]}], n3,
                                                                use_tqdm=False)[0] for _ in range(2)]
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]
    assert len(outs[0].outputs) == 3 and all(0 < len(c.token_ids) <= 24 for c in outs[0].outputs)


def _tiny_engine(speculative: SpeculativeConfig | None):
    """A 2-layer random model with peaked logits (std 0.5), so a few tokens carry the mass."""
    from ferrylm.model.runner import ModelRunner
    from tests.gpu.random_model import RandomCheckpoint, build_engine, model_config

    config = model_config("tiny", max_positions=512)
    runner = ModelRunner(RandomCheckpoint(config, seed=3, std=0.5), CacheConfig(block_size=16, num_blocks=4097),
                         torch.float32, torch.device("cpu"), 512, max_num_seqs=512, enforce_eager=True,
                         attention="torch", speculative=speculative)
    return build_engine(runner, num_blocks=4096, max_model_len=512, max_num_seqs=512, max_num_batched_tokens=8192)


def _second_tokens(engine, n: int) -> tuple[torch.Tensor, int]:
    """The second generated token of `n` seeded requests (temperature 1, top_k 6), and the draft
    steps taken. Every token occurs once in the prompt, so prompt lookup always drafts after the first."""
    prompt = torch.randperm(320, generator=torch.Generator().manual_seed(0)).tolist()
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, top_k=6, max_tokens=3, seed=i,
                                                          ignore_eos=True))
    done = run_to_completion(engine)
    return torch.tensor([done[str(i)][1] for i in range(n)]), engine.stats().spec_decode_num_drafts


def test_sampled_output_distribution_is_unchanged_by_speculation():
    """2 x k chi-square homogeneity test on the second token (drafted, then verified by rejection
    sampling in the speculative run): the same distribution with and without drafts."""
    n = 3000
    plain, _ = _second_tokens(_tiny_engine(None), n)
    spec, drafts = _second_tokens(_tiny_engine(SpeculativeConfig("ngram", 2, disable_by_batch_size=4096)), n)
    assert drafts >= n  # every request verified a draft
    assert homogeneity_p_value(plain, spec, 320) > 1e-3


def homogeneity_p_value(a_tokens: torch.Tensor, b_tokens: torch.Tensor, vocab: int) -> float:
    """2 x k chi-square homogeneity test of two equal-size samples of token ids: the p-value."""
    n = len(a_tokens)
    a, b = torch.bincount(a_tokens, minlength=vocab).double(), torch.bincount(b_tokens, minlength=vocab).double()
    cells = (a + b) > 0
    a, b = a[cells], b[cells]
    pooled = (a + b) / (2 * n)
    stat = ((a - pooled * n) ** 2 / (pooled * n) + (b - pooled * n) ** 2 / (pooled * n)).sum()
    df = torch.tensor(float(cells.sum() - 1), dtype=torch.double)
    assert df >= 3, "the test needs a spread-out distribution"
    return float(torch.special.gammaincc(df / 2, stat / 2))


@requires_smollm2
def test_guided_requests_speculate_and_keep_their_output(llm_fp32):
    """Structured output with drafts: each draft position is masked with the grammar after the guesses
    before it (the matcher rolled back after), a guess the grammar refuses ends the draft; the output
    equals plain guided decoding and is valid (the masking itself: the test after this one)."""
    import json

    from ferrylm.sampling_params import StructuredOutputsParams as Spec

    items = ["apple", "banana", "cherry", "date", "elderberry", "fig", "grape"]
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
              "required": ["fruits"]}
    questions = [f"Return this list as JSON with the key fruits: {', '.join(items)}.",
                 "Count from 1 to 30, separated by commas."]
    prompts = chat_prompt_ids(llm_fp32, questions)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Spec(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=Spec(regex=r"(\d+, ){5,40}\d+"))]
    plain, _ = _run(llm_fp32, prompts, params)
    with speculating(llm_fp32):
        spec, engine = _run(llm_fp32, prompts, params)
    assert spec == plain
    assert engine.stats().spec_decode_num_accepted_tokens > 10
    text = llm_fp32.get_tokenizer().decode(spec[0])
    assert isinstance(json.loads(text)["fruits"], list)


@requires_smollm2
def test_draft_rows_are_masked_by_the_grammar_after_each_guess(llm_fp32):
    """mask_draft_rows: row j allows what the grammar allows after the first j guesses, the draft is
    cut at the first guess the grammar refuses, and the matcher ends where it started."""
    from ferrylm.model.structured.structured_output import mask_draft_rows, new_matcher
    from ferrylm.sampling_params import StructuredOutputsParams as Spec

    tok = llm_fp32.get_tokenizer()
    matcher = new_matcher(llm_fp32.engine.grammars.submit(Spec(regex=r"ab(c|d)[0-9]")).result())
    a, b, c, d, x = (tok.encode(s, add_special_tokens=False)[0] for s in "abcdx")
    vocab = llm_fp32.engine.vocab_size
    logits = torch.zeros(4, vocab)
    assert mask_draft_rows(logits, 0, matcher, [a, b, x]) == 2  # x refused: rows 0..2 used
    allowed = [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits[:3]]
    assert a in allowed[0] and not {b, c, x} & allowed[0]
    assert b in allowed[1] and not {a, c, x} & allowed[1]
    assert {c, d} <= allowed[2] and not {a, b, x} & allowed[2]
    assert bool((logits[3] == 0).all())  # past the cut: untouched
    assert matcher.accept_token(a) and not matcher.accept_token(x)  # rolled back to the start


@requires_smollm2
def test_requests_with_logprobs_speculate_with_each_positions_logprobs(llm_fp32, prompts):
    """Every emitted token, drafted or not, carries the logprobs of its own position's row: equal to
    plain decoding's (float32), with drafts accepted."""
    from ferrylm import LLM

    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0, frequency_penalty=0.05)]

    def run(spec: bool):
        with speculating(llm_fp32) if spec else contextlib.nullcontext():
            engine = engine_like(llm_fp32)
            outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in prompts[:3]] * 2,
                                                   (params * 2)[:3] * 2, use_tqdm=False)
            return [o.outputs[0] for o in outs], engine

    plain, _ = run(False)
    spec, engine = run(True)
    assert engine.stats().spec_decode_num_accepted_tokens > 10
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(getattr(la[t], "logprob", la[t]) - getattr(lb[t], "logprob", lb[t])) for t in la) < 1e-4
        assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3
