"""The prefix cache's tiers through a real `ferrylm serve`: a replica stopped (SIGTERM) after the first
turn of six conversations and started again on the same --kv-offload-disk-path serves the second
turn's prefixes from disk (its /metrics say so) with the tokens of an engine without any cache."""

from __future__ import annotations

import pytest

from ferrylm.engine.llm import LLM
from ferrylm.sampling_params import SamplingParams
from tests.e2e.server_process import ServerProcess
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

CONTEXTS = [[1] + [10 + 17 * s + i for i in range(40)] for s in range(6)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("tiers-serve") / "base"))


def _reference(model) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy turns 1 and 2 offline, with no prefix cache at all."""
    llm = LLM(str(model), dtype="float32", enable_prefix_caching=False, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": c} for c in CONTEXTS], params, use_tqdm=False)]
    second = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in _second_prompts(first)], params, use_tqdm=False)]
    return first, second


def _second_prompts(first: list[list[int]]) -> list[list[int]]:
    return [c + f + [200 + s, 201, 202, 203] for s, (c, f) in enumerate(zip(CONTEXTS, first))]


def _serve(model, disk) -> ServerProcess:
    server = ServerProcess("--model", str(model), "--served-model-name", "base", "--dtype", "float32",
                           "--block-size", "8", "--num-gpu-blocks-override", "16", "--max-num-seqs", "2",
                           "--kv-offload-cpu-gib", "0.0001", "--kv-offload-disk-path", str(disk))
    server.wait_ready()
    return server


def _complete(server: ServerProcess, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        out = server.client().completions.create(model="base", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True, "skip_special_tokens": False})
        outs.append([int(word[1:]) for word in out.choices[0].text.split()])  # word i is "t{i}"
    return outs


def test_a_restarted_replica_serves_prefixes_from_disk(model, tmp_path):
    first, second = _reference(model)
    server = _serve(model, tmp_path)
    try:
        assert _complete(server, CONTEXTS) == first
        written = server.wait_idle()["ferrylm:kv_offload_disk_blocks_written_total"]
    finally:
        assert server.stop() == 0
    assert len(list(tmp_path.glob("*/*.kv"))) >= max(written, 6 * 6)  # the shutdown wrote the pool's blocks too
    server = _serve(model, tmp_path)
    try:
        before = server.metrics()
        assert before["ferrylm:kv_offload_disk_usage_perc"] > 0  # found at start
        assert _complete(server, _second_prompts(first)) == second
        after = server.wait_idle()
        assert after["ferrylm:kv_offload_disk_hit_tokens_total"] >= 6 * 40
        assert after["ferrylm:kv_offload_disk_blocks_lost_total"] == 0
        assert after["ferrylm:prefix_cache_hits_total"] >= 6 * 40
        assert after["ferrylm:kv_offload_disk_read_seconds_total"] > 0
    finally:
        assert server.stop() == 0
