"""Gemma 3 (text) end to end: a random-weight tiny Gemma3ForCausalLM (4 layers: 3 sliding with a
window of 8 tokens, 1 full with linear RoPE scaling, logit soft cap) served by the engine with
4-token blocks, prefix caching and 16-token steps (chunked prefill) equals transformers' greedy
loop token for token, logprobs within 1e-4: prompts longer than the window, one shorter whose
generation crosses it, batched and alone, on the C++ CPU backend and the torch one. A window of
512 gives other tokens (and transformers' with the same window), so the window is really applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferrylm import SamplingParams
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model, transformers_greedy

transformers = pytest.importorskip("transformers")

TOKENS = 32
SHARED = [5, 9, 33, 70, 41, 18, 27, 64, 12, 90, 101, 7, 55, 38, 29, 77, 150, 3]
PROMPTS = [SHARED + [200 + i] * (1 + 9 * i) for i in range(3)] + [[5, 9, 33]]  # the last: shorter than the window


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(directory, transformers' greedy (tokens, logprobs) of each prompt)."""
    directory = add_word_tokenizer(make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3")))
    return str(directory), [_greedy_reference(directory, p) for p in PROMPTS]


def _greedy_reference(directory, prompt: list[int]) -> tuple[list[int], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return transformers_greedy(model, prompt, TOKENS)


def _generate(directory: str, prompts: list[list[int]], **kw):
    from ferrylm import LLM

    llm = LLM(directory, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True, enforce_eager=True,
              block_size=4, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # alone; its blocks cached
    return llm, first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_equals_transformers_with_sliding_window(backend, gemma3, monkeypatch):
    from ferrylm.model.attention.cpu_kernels import load_cpu_kernels

    if backend == "torch":
        monkeypatch.setenv("FERRYLM_DISABLE_CPU_KERNELS", "1")  # select_backend falls back to torch-native
    directory, reference = gemma3
    llm, outs = _generate(directory, PROMPTS)
    want_backend = "TorchNativeBackend" if backend == "torch" or load_cpu_kernels() is None else "CpuBackend"
    assert type(llm.engine.executor.attn_backend).__name__ == want_backend
    assert all(o.num_cached_tokens >= 16 for o in outs[1:3])  # the shared prefix came from the cache
    for out, (want_tokens, want_logprobs) in zip(outs, reference):
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(lp[t] - w) for lp, t, w in zip(got.logprobs, got.token_ids, want_logprobs)) < 1e-4


def test_the_window_changes_the_output(gemma3, tmp_path):
    """The same weights with a 512-token window (wider than every sequence here): other tokens than
    with the 8-token window, and transformers' with the same 512-token window."""
    directory, reference = gemma3
    wide = tmp_path / "wide"
    wide.mkdir()
    for f in Path(directory).iterdir():
        (wide / f.name).write_bytes(f.read_bytes())
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
    prompt = PROMPTS[2]
    _, outs = _generate(str(wide), [prompt])
    got = outs[0].outputs[0].token_ids
    assert got == _greedy_reference(wide, prompt)[0]
    assert got != reference[2][0]


def test_speculative_verification_rows_slide_too(gemma3):
    """ngram drafts are verified as multi-token rows (the prefill path): greedy output unchanged."""
    directory, reference = gemma3
    llm, outs = _generate(directory, PROMPTS[1:3], speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert llm.engine.stats().spec_decode_num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == [r[0] for r in reference[1:3]]


def test_config_layouts_and_load_errors(gemma3, tmp_path):
    """transformers 4's config.json (rope_theta, rope_local_base_freq, rope_scaling, a window
    pattern) reads like transformers 5's nested rope_parameters; attn_logit_softcapping and a
    backend without windows are load errors naming them; the unsupported-architecture error lists
    Gemma 3."""
    from ferrylm.model.attention.triton import TritonBackend
    from ferrylm.model.loaders.hf_loader import load_hf_config
    from ferrylm.model.loaders.loader import Checkpoint, load_model
    from ferrylm.model.loaders.model_source import ModelLoadError, resolve_model

    directory, _ = gemma3
    new = load_hf_config(Path(directory), "g")
    assert (new.sliding_window, new.sliding_layers, new.local_rope_theta, new.rope_theta) == (8, (0, 2, 3), 100.0,
                                                                                              1e6)
    assert dict(new.rope_scaling or ()) == {"rope_type": "linear", "factor": 2.0}
    assert (new.query_pre_attn_scalar, new.final_logit_softcapping, new.hidden_act) == (24, 30.0, "gelu_pytorch_tanh")
    config = json.loads((Path(directory) / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    old |= {"rope_theta": 1e6, "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "sliding_window_pattern": 2}
    (tmp_path / "config.json").write_text(json.dumps(old))
    legacy = load_hf_config(tmp_path, "g")
    assert legacy.sliding_layers == (0, 2) and (legacy.rope_theta, legacy.local_rope_theta) == (1e6, 100.0)
    assert legacy.rope_scaling == new.rope_scaling
    (tmp_path / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        load_hf_config(tmp_path, "g")
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*Gemma3ForCausalLM"):
        load_hf_config(tmp_path, "g")
    assert TritonBackend.supports_sliding_window is True  # every backend built in slides (GPU: tests/gpu)
    with pytest.raises(ModelLoadError, match="sliding-window attention .window 8. is not supported by the"):
        load_model(Checkpoint(resolve_model(directory)), torch.float32, torch.device("cpu"), object())


def test_multimodal_checkpoint_serves_its_language_model(gemma3, tmp_path):
    """Gemma3ForConditionalGeneration: text_config listing only what differs from Gemma3TextConfig's
    defaults, weights under model.language_model. (transformers 5) or language_model.model.
    (transformers 4), vision tensors beside them (not read): the text-only checkpoint's weights."""
    from safetensors.torch import load_file, save_file

    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.loaders.loader import Checkpoint, load_model
    from ferrylm.model.loaders.model_source import resolve_model

    directory, _ = gemma3
    text = json.loads((Path(directory) / "config.json").read_text())
    weights = load_file(str(Path(directory) / "model.safetensors"))
    want = load_model(Checkpoint(resolve_model(directory)), torch.float32, torch.device("cpu"), TorchNativeBackend())
    defaults = {"hidden_activation", "rms_norm_eps", "tie_word_embeddings", "attn_logit_softcapping"}
    for prefix in ("model.language_model.", "language_model.model."):
        mm = tmp_path / prefix.replace(".", "_")
        mm.mkdir()
        (mm / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                    "text_config": {k: v for k, v in text.items()
                                                                    if k not in defaults}}))
        save_file({**{prefix + k.removeprefix("model."): v for k, v in weights.items()},
                   "model.vision_tower.patch.weight": torch.ones(2, 2)}, str(mm / "model.safetensors"))
        got = load_model(Checkpoint(resolve_model(str(mm))), torch.float32, torch.device("cpu"), TorchNativeBackend())
        assert got.config.sliding_layers == want.config.sliding_layers
        for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_a_prefill_step_builds_its_window_mask_once(gemma3, monkeypatch):
    """The tiny Gemma 3 has three sliding layers: a prefill chunk past the window builds its window mask
    once for the step (PrefillChunk.window_masks), and every sliding layer uses it."""
    from ferrylm import LLM
    from ferrylm.model.attention import torch_native
    from ferrylm.model.forward_batch import ForwardBatch

    calls = []
    build = torch_native.window_mask
    monkeypatch.setattr(torch_native, "window_mask", lambda *args: calls.append(args) or build(*args))
    directory, _ = gemma3
    runner = LLM(directory, dtype="float32", enforce_eager=True, block_size=4).engine.executor
    prompt = PROMPTS[2]  # 37 tokens, window 8
    batch = ForwardBatch.build([prompt], [0], [list(range(-(-len(prompt) // 4)))], 4)
    with torch.no_grad():
        runner.model(batch, runner.kv_caches)
    assert len(runner.config.sliding_layers) == 3
    assert len(calls) == 1, calls
