"""Each architecture beyond Llama end to end through the engine: a random-weight tiny checkpoint
(transformers' config class, saved as safetensors), four prompts batched with a shared prefix
(prefix caching) and a 16-token step budget (chunked prefill), 32 greedy tokens each: the same
tokens as transformers' greedy loop on the same weights, logprobs within 1e-4."""

from __future__ import annotations

import json

import pytest
import torch

from ferrylm import SamplingParams
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model, transformers_greedy

transformers = pytest.importorskip("transformers")

TOKENS = 32
SHARED = [5, 9, 33, 70, 41, 18, 27, 64, 12, 90, 101, 7, 55, 38, 29, 77, 150, 3]  # > one 16-token block


def _greedy_reference(directory, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return transformers_greedy(model, prompt, TOKENS)


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "mixtral", "qwen3_moe", "llama4"])
def test_greedy_equals_transformers_batched_with_prefix_cache_and_chunks(kind, tmp_path):
    from ferrylm import LLM

    directory = str(add_word_tokenizer(make_tiny_model(kind, tmp_path / kind)))
    prompts = [SHARED + [200 + i] * (1 + 9 * i) for i in range(4)]
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # its blocks are then cached
    outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs[1:])  # the shared prefix came from the cache
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logprobs = _greedy_reference(directory, prompt)
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(lp[t] - w) for lp, t, w in zip(got.logprobs, got.token_ids, want_logprobs)) < 1e-4


def test_sliding_windows_are_read_as_transformers_applies_them(tmp_path):
    """Mistral / Phi-3 slide every layer; Qwen only with use_sliding_window, on its layer_types (from
    max_window_layers on); the served context is not cut to the window."""
    from ferrylm.model.loaders.hf_loader import load_hf_config

    mistral = load_hf_config(make_tiny_model("mistral", tmp_path / "m", sliding_window=48), "m")
    phi3 = load_hf_config(make_tiny_model("phi3", tmp_path / "p", sliding_window=48), "p")
    qwen_off = load_hf_config(make_tiny_model("qwen3", tmp_path / "q", sliding_window=48), "q")
    qwen_on = load_hf_config(make_tiny_model("qwen2", tmp_path / "q2", sliding_window=48, use_sliding_window=True,
                                             max_window_layers=1), "q2")
    wide = load_hf_config(make_tiny_model("mistral", tmp_path / "w", sliding_window=4096), "w")
    assert (mistral.sliding_window, mistral.sliding_layers, mistral.max_position_embeddings) == (48, (0, 1), 512)
    assert (phi3.sliding_window, phi3.sliding_layers) == (48, (0, 1))
    assert (qwen_off.sliding_layers, qwen_off.max_position_embeddings) == ((), 512)
    assert (qwen_on.sliding_window, qwen_on.sliding_layers) == (48, (1,))
    assert wide.sliding_layers == ()  # a window past the context cuts nothing


@pytest.mark.parametrize("kind,overrides", [
    ("mistral", {"sliding_window": 8}), ("phi3", {"sliding_window": 8}), ("mixtral", {"sliding_window": 8}),
    ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1})])
def test_a_sliding_window_model_equals_transformers_past_its_window(kind, overrides, tmp_path):
    """Prompts of 19-46 tokens and 32 new ones, windows of 8: every query's window cuts its context,
    in prefill chunks (16 tokens), from prefix-cache hits and in decode; greedy equals transformers."""
    from ferrylm import LLM

    directory = str(add_word_tokenizer(make_tiny_model(kind, tmp_path / kind, **overrides)))
    prompts = [SHARED + [200 + i] * (1 + 9 * i) for i in range(4)]
    llm = LLM(directory, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs[1:])
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logprobs = _greedy_reference(directory, prompt)
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(lp[t] - w) for lp, t, w in zip(got.logprobs, got.token_ids, want_logprobs)) < 1e-4


def test_rope_scaling_we_cannot_honour_is_a_load_error_naming_it(tmp_path):
    from ferrylm.model.loaders.hf_loader import load_hf_config
    from ferrylm.model.loaders.model_source import ModelLoadError

    directory = make_tiny_model("phi3", tmp_path / "p")
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] |= {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="rope_scaling type 'longrope' is not supported"):
        load_hf_config(directory, "p")


def test_moe_routes_by_expert_not_by_token(tmp_path):
    """Each active expert runs once per step over all its tokens; TP of an MoE model splits each
    expert's columns (test_tensor_parallel compares it with TP=1); expert parallelism of a dense
    model is a clear ConfigError."""
    from ferrylm.config import ConfigError
    from ferrylm.model.arch.moe import SparseMoeBlock
    from ferrylm.model.loaders.hf_loader import load_hf_config
    from ferrylm.model.parallel.tp import shard_plan

    config = load_hf_config(make_tiny_model("mixtral", tmp_path / "x"), "x")
    block = SparseMoeBlock(config)
    calls = []
    for expert in block.experts:
        expert.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    block(torch.randn(40, config.hidden_size))
    assert len(calls) <= config.num_experts and sum(calls) == 40 * config.num_experts_per_tok
    assert shard_plan(config, 1, 2).expert_intermediate == range(64, 128)  # TP splits each expert's columns
    with pytest.raises(ConfigError, match="--enable-expert-parallel needs a mixture-of-experts model"):
        shard_plan(load_hf_config(make_tiny_model("phi3", tmp_path / "p"), "p"), 0, 2, expert_parallel=True)


def test_moe_target_with_a_dense_draft_equals_plain_decoding(tmp_path):
    """A Mixtral target drafted by a small dense Llama of the same vocabulary (draft_model): greedy
    output identical to the target alone; `--quantization int8` packs every expert too."""
    from ferrylm import LLM

    target = str(add_word_tokenizer(make_tiny_model("mixtral", tmp_path / "moe")))
    draft = str(add_word_tokenizer(make_tiny_model("llama", tmp_path / "draft", num_hidden_layers=1)))
    prompts = [{"prompt_token_ids": SHARED + [200 + i] * (1 + 5 * i)} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(target, dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    spec = LLM(target, dtype="float32", enforce_eager=True, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    drafted = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats().spec_decode_num_draft_tokens > 0
    int8 = LLM(target, dtype="float32", enforce_eager=True, quantization="int8")
    expert = int8.engine.executor.model.layers[0].mlp.experts[0]  # TP 1: the runner is the executor
    assert expert.gate_up_proj.quant.name == "int8" and expert.down_proj.quant.name == "int8"
    assert len(int8.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_llama4_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Llama 4 ships as Llama4ForConditionalGeneration: config under text_config, weights under
    language_model.; the text model loads from it (the vision tower's tensors are not read) and
    gives the text-only checkpoint's logits."""
    from safetensors.torch import load_file, save_file

    from ferrylm.model.forward_batch import ForwardBatch
    from tests.model.test_tiny_models import _ours

    text = make_tiny_model("llama4", tmp_path / "text")
    both = tmp_path / "multimodal"
    both.mkdir()
    weights = {f"language_model.{k}": v for k, v in load_file(str(text / "model.safetensors")).items()}
    save_file(weights | {"vision_model.patch_embedding.weight": torch.zeros(8, 8)}, str(both / "model.safetensors"))
    text_config = json.loads((text / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({"architectures": ["Llama4ForConditionalGeneration"],
                                                  "text_config": text_config, "vision_config": {}}))
    prompt = list(range(3, 40))
    logits = []
    for directory in (text, both):
        model, caches = _ours(directory)
        with torch.no_grad():
            logits.append(model.compute_logits(model(ForwardBatch.build([prompt], [0], [list(range(4))], 16), caches)))
    assert torch.equal(logits[0], logits[1])
