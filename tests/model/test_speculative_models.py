"""Speculative decoding with a model proposer (draft_model: a second model with its own K/V over the
target's block ids; layer_skip: the target's first layers): greedy output is token for token that of
plain decoding on SmolLM2 with chunked prefill, a prefix hit and preemption; a draft identical to
the target has every guess accepted (its K/V bookkeeping is exact); sampled output keeps the
target's distribution when q differs from p (chi-square); random add/step/abort runs keep the block
accounting and the greedy outputs; configs that cannot work are start-up errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm import SamplingParams
from ferrylm.config import CacheConfig, ConfigError, SpeculativeConfig
from tests.conftest import chat_prompt_ids, requires_smollm2, run_to_completion
from tests.gpu.random_model import RandomCheckpoint, build_engine, model_config
from tests.model.draft_models import write_random, write_truncated
from tests.model.prompts import SIXTEEN_PROMPTS
from tests.model.test_speculative_engine import GROUNDED, _run, homogeneity_p_value, speculating

TINY = model_config("tiny", max_positions=512)


@pytest.fixture(scope="module")
def smol_draft(tmp_path_factory):
    """SmolLM2's first 20 layers as a draft checkpoint (float32 safetensors; users are marked
    requires_smollm2)."""
    return str(write_truncated("smollm2-135m", 20, tmp_path_factory.mktemp("draft") / "smol20"))


@pytest.fixture(scope="module")
def tiny_drafts(tmp_path_factory):
    """Draft checkpoints for the tiny target (seed 3, std 0.5): the same weights, and the same ones
    scaled (q near p but not p)."""
    root = tmp_path_factory.mktemp("tiny_drafts")
    return {"same": str(write_random(TINY, root / "same", seed=3, std=0.5)),
            "other": str(write_random(TINY, root / "other", seed=3, std=0.4))}


def _methods(draft_path: str) -> list[SpeculativeConfig]:
    return [SpeculativeConfig("layer_skip", 3, num_layers=24, disable_by_batch_size=64),
            SpeculativeConfig("draft_model", 3, model=draft_path, disable_by_batch_size=64)]


@requires_smollm2
def test_greedy_with_model_drafts_equals_plain_decoding(llm_fp32, smol_draft):
    prompts = chat_prompt_ids(llm_fp32, GROUNDED[:3] + SIXTEEN_PROMPTS[:3])
    shared = prompts[1] * 3  # the second of the pair is admitted on a prefix hit
    batch = prompts + [shared + [28], shared + [29]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = _run(llm_fp32, batch, params, max_num_batched_tokens=64)
    for config in _methods(smol_draft):
        with speculating(llm_fp32, config):
            spec, engine = _run(llm_fp32, batch, params, max_num_batched_tokens=64)
        assert spec == plain, config.method
        stats = engine.stats()
        assert stats.spec_decode_num_accepted_tokens > 10, (config.method, stats)
        assert stats.prefix_cache_hits > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.long  # preemption with drafts: also test_random_add_step_abort_with_model_drafts (10-block pool)
@requires_smollm2
def test_model_drafts_under_preemption_keep_greedy_output(llm_fp32, smol_draft):
    prompts = chat_prompt_ids(llm_fp32, SIXTEEN_PROMPTS[:6])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain, _ = _run(llm_fp32, prompts, params)
    for config in _methods(smol_draft):
        with speculating(llm_fp32, config):
            spec, engine = _run(llm_fp32, prompts, params, num_blocks=20, max_num_batched_tokens=128)
        assert engine.scheduler.num_preemptions > 0
        assert spec == plain, config.method


def _tiny_engine(speculative: SpeculativeConfig | None, num_blocks: int = 4096, max_num_batched_tokens: int = 8192):
    """A 2-layer random model with peaked logits (std 0.5), so a few tokens carry the mass."""
    from ferrylm.model.runner import ModelRunner

    runner = ModelRunner(RandomCheckpoint(TINY, seed=3, std=0.5), CacheConfig(block_size=16, num_blocks=4097),
                         torch.float32, torch.device("cpu"), 512, max_num_seqs=512, enforce_eager=True,
                         attention="torch", speculative=speculative)
    return build_engine(runner, num_blocks=num_blocks, max_model_len=512, max_num_seqs=512,
                        max_num_batched_tokens=max_num_batched_tokens)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (int(torch.randint(5, 60, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_a_draft_identical_to_the_target_has_every_guess_accepted(tiny_drafts):
    """K = 20 guesses span two scratch blocks; chunked prefill and preemption (a 14-block pool) make
    the draft catch up from the middle and from scratch. Any misplaced draft K/V shows as rejections."""
    prompts = _prompts(8)
    config = SpeculativeConfig("draft_model", 20, model=tiny_drafts["same"], disable_by_batch_size=64)
    for params in (SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
                   SamplingParams(temperature=1.0, top_k=8, seed=7, max_tokens=60, ignore_eos=True)):
        plain = _tiny_engine(None, num_blocks=14, max_num_batched_tokens=48)
        spec = _tiny_engine(config, num_blocks=14, max_num_batched_tokens=48)
        outs = []
        for engine in (plain, spec):
            for i, ids in enumerate(prompts):
                engine.add_request(str(i), ids, params)
            outs.append(run_to_completion(engine, check=True))
        stats = spec.stats()
        assert spec.scheduler.num_preemptions > 0
        assert stats.spec_decode_num_draft_tokens > 100
        assert stats.spec_decode_num_accepted_tokens >= 0.97 * stats.spec_decode_num_draft_tokens, stats
        if params.greedy:
            assert outs[0] == outs[1]
        assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def _second_tokens(engine, n: int) -> tuple[torch.Tensor, int]:
    prompt = torch.randperm(320, generator=torch.Generator().manual_seed(0)).tolist()[:64]
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(temperature=1.0, top_k=6, max_tokens=3, seed=i,
                                                          ignore_eos=True))
    done = run_to_completion(engine)
    return torch.tensor([done[str(i)][1] for i in range(n)]), engine.stats().spec_decode_num_drafts


def test_sampled_distribution_is_the_targets_with_a_draft_models_q(tiny_drafts):
    """2 x k chi-square homogeneity test on the second token, which the speculative run drafts from
    another model's q and verifies by rejection sampling with that q."""
    n = 3000
    plain, _ = _second_tokens(_tiny_engine(None), n)
    config = SpeculativeConfig("draft_model", 2, model=tiny_drafts["other"], disable_by_batch_size=4096)
    engine = _tiny_engine(config)
    spec, drafts = _second_tokens(engine, n)
    assert drafts >= n
    # q is used, not a one-hot on the guess (also exact, but accepting only p(x) of the time: ~20% here)
    assert engine.stats().spec_decode_num_accepted_tokens > 0.5 * n
    assert homogeneity_p_value(plain, spec, 320) > 1e-3


_OPS = st.lists(st.one_of(st.tuples(st.just("add"), st.integers(0, 7)), st.tuples(st.just("step"), st.integers(1, 4)),
                          st.tuples(st.just("abort"), st.integers(0, 40))), min_size=1, max_size=25)


@pytest.fixture(scope="module")
def tiny_runs(tiny_drafts):
    """Plain greedy outputs of the op prompts, and one speculative engine per method (its runner reused)."""
    prompts = _prompts(8, seed=1)
    plain = _tiny_engine(None)
    for i, ids in enumerate(prompts):
        plain.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    expected = run_to_completion(plain)
    runners = [_tiny_engine(SpeculativeConfig("layer_skip", 3, num_layers=1, disable_by_batch_size=64)).executor,
               _tiny_engine(SpeculativeConfig("draft_model", 3, model=tiny_drafts["same"],
                                              disable_by_batch_size=64)).executor]
    return prompts, [expected[str(i)] for i in range(len(prompts))], runners


@settings(max_examples=20)
@given(ops=_OPS, method=st.integers(0, 1))
def test_random_add_step_abort_with_model_drafts(tiny_runs, ops, method):
    """Block accounting holds after every step, every block comes back, and each request that runs
    to the end (a preempting 10-block pool, 40-token budget) has plain decoding's greedy output."""
    prompts, expected, runners = tiny_runs
    engine = build_engine(runners[method], num_blocks=10, max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    added: dict[str, int] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()

    for op, arg in ops:
        if op == "add":
            rid = f"r{len(added)}"
            added[rid] = arg
            engine.add_request(rid, prompts[arg], params)
        elif op == "step":
            for _ in range(arg):
                step()
        elif added:
            rid = sorted(added)[arg % len(added)]
            aborted.add(rid)
            engine.abort(rid)
    while engine.has_unfinished_requests():
        step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for rid, prompt_index in added.items():
        if rid not in aborted:
            assert done[rid] == expected[prompt_index], rid


def test_configs_that_cannot_work_with_the_target_are_errors(tmp_path, tiny_drafts):
    from ferrylm.model.spec.draft_setup import check_against_target

    with pytest.raises(ConfigError, match="num_layers 2 must be below"):
        check_against_target(SpeculativeConfig("layer_skip", 2, num_layers=2), TINY)
    other_vocab = dataclasses.replace(TINY, vocab_size=256)
    path = write_random(other_vocab, tmp_path / "v256")
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens, the target 320"):
        check_against_target(SpeculativeConfig("draft_model", 2, model=str(path)), TINY)
    with pytest.raises(ConfigError, match="no such model"):
        check_against_target(SpeculativeConfig("draft_model", 2, model=str(tmp_path / "missing")), TINY)
    check_against_target(SpeculativeConfig("draft_model", 2, model=tiny_drafts["same"]), TINY)
    for bad, message in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                         ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs 'num_layers'"),
                         ({"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 0}, "needs 'num_layers'"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "do not apply"),
                         ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "prompt_lookup_max": 3},
                          "do not apply"),
                         ({"method": "eagle", "num_speculative_tokens": 2}, "not implemented")]:
        with pytest.raises(ConfigError, match=message):
            SpeculativeConfig.parse(bad)
