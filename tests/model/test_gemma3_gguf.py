"""Gemma 3 from GGUF (llama.cpp's arch `gemma3`): files written here with the gguf package from the
random-weight tiny Gemma 3, as llama.cpp's converter writes them (its keys, its tensor names from
gguf's own name map, every norm weight + 1), served by the engine (4-token blocks, prefix caching,
16-token steps) with the safetensors directory's word tokenizer.

The tiny model keeps to what a Gemma 3 GGUF can say, since llama.cpp fixes the rest by convention:
6 layers (every 6th full: layers 0-4 slide over 8 tokens, layer 5 attends fully with linear RoPE
scaling), local RoPE base 10000, query_pre_attn_scalar = head_dim = 256 (Gemma 3 1B/4B/12B's), a
logit soft cap. F32: greedy tokens equal transformers' on the safetensors model, logprobs within
1e-4; transformers' own GGUF reader gets the same weights and layer kinds from the file. Q8_0 / Q4_0
/ Q4_1 linears (kept packed) and embedding: greedy tokens equal transformers' on the file's
dequantized weights, logprobs within 1e-3.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ferrylm import SamplingParams
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model, transformers_greedy

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

TOKENS = 32
SHARED = [5, 9, 33, 70, 41, 18, 27, 64, 12, 90, 101, 7, 55, 38, 29, 77, 150, 3]
PROMPTS = [SHARED + [200 + i] * (1 + 9 * i) for i in range(2)]  # 19 and 28 tokens: longer than the window
GGUF_SHAPE = dict(num_hidden_layers=6, layer_types=None, head_dim=256, query_pre_attn_scalar=256,
                  rope_local_base_freq=10000.0)
# a mix of block formats; q / k / v in three of them (one packed projection, segmented)
QUANTIZED = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0, "attn_output": T.Q8_0,
             "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"hf": the safetensors directory, "f32": its F32 GGUF, "q": a quantized GGUF, "twin": a
    safetensors directory of the quantized file's dequantized weights}."""
    root = tmp_path_factory.mktemp("gemma3_gguf")
    hf = add_word_tokenizer(make_tiny_model("gemma3", root / "hf", **GGUF_SHAPE))
    _write_gguf(root / "f32.gguf", hf, lambda _: T.F32)
    twin = root / "twin"
    shutil.copytree(hf, twin)
    _write_gguf(root / "q.gguf", hf, lambda name: QUANTIZED.get(name, T.F32), twin=twin)
    return {"hf": hf, "f32": root / "f32.gguf", "q": root / "q.gguf", "twin": twin}


def _write_gguf(path: Path, directory: Path, kind_of: Callable[[str], object], twin: Path | None = None) -> None:
    """`directory`'s model as llama.cpp's converter writes it; `kind_of(base name)` picks each 2-D
    tensor's format. With `twin`, the weights the file holds, dequantized, go to its safetensors."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((directory / "config.json").read_text())
    full_rope = cfg["rope_parameters"]["full_attention"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in [(writer.add_context_length, cfg["max_position_embeddings"]),
                       (writer.add_embedding_length, cfg["hidden_size"]),
                       (writer.add_block_count, cfg["num_hidden_layers"]),
                       (writer.add_feed_forward_length, cfg["intermediate_size"]),
                       (writer.add_head_count, cfg["num_attention_heads"]),
                       (writer.add_head_count_kv, cfg["num_key_value_heads"]),
                       (writer.add_key_length, cfg["head_dim"]), (writer.add_value_length, cfg["head_dim"]),
                       (writer.add_layer_norm_rms_eps, cfg["rms_norm_eps"]),
                       (writer.add_rope_freq_base, full_rope["rope_theta"]),
                       (writer.add_rope_scaling_type, gguf.RopeScalingType.LINEAR),
                       (writer.add_rope_scaling_factor, full_rope["factor"]),
                       (writer.add_sliding_window, cfg["sliding_window"]),
                       (writer.add_final_logit_softcapping, cfg["final_logit_softcapping"]),
                       (writer.add_vocab_size, cfg["vocab_size"]),
                       (writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2)]:
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg["num_hidden_layers"])
    dequantized = {}
    for hf_name, tensor in load_file(str(directory / "model.safetensors")).items():
        base = names.get_name(hf_name.removesuffix(".weight"))
        assert base is not None, hf_name
        array = (tensor + 1 if hf_name.endswith("norm.weight") else tensor).float().numpy()  # x * w in llama.cpp
        kind = kind_of(base.split(".")[-1]) if tensor.dim() == 2 else T.F32
        if kind == T.F32:
            writer.add_tensor(f"{base}.weight", array)
            dequantized[hf_name] = tensor
        else:
            blocks = gguf.quants.quantize(array, kind)
            writer.add_tensor(f"{base}.weight", blocks, raw_dtype=kind)
            dequantized[hf_name] = torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if twin is not None:
        save_file(dequantized, str(twin / "model.safetensors"))


def _greedy_reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    return transformers_greedy(model, prompt, TOKENS)


def _hf_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)


def _generate(path: Path, tokenizer_directory: Path):
    """The engine on the GGUF file, tokenizing with the safetensors directory's tokenizer (the file has
    none): the first prompt alone, then the others (their shared prefix from the cache)."""
    from ferrylm import LLM
    from ferrylm.engine.engine import Engine
    from ferrylm.engine_args import engine_config
    from ferrylm.executor import build_executor
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    config = engine_config(model=str(path), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True,
                           enforce_eager=True, block_size=4)
    built = build_executor(config)
    llm = LLM.from_engine(Engine(config, built.executor, Tokenizer.load(resolve_model(str(tokenizer_directory))),
                                 built.max_model_len))
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    return llm, first + llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False)


def _assert_greedy_equal(outs, reference, tolerance: float) -> None:
    for out, (want_tokens, want_logprobs) in zip(outs, reference, strict=True):
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(lp[t] - w) for lp, t, w in zip(got.logprobs, got.token_ids, want_logprobs)) < tolerance


def test_metadata_reads_as_the_safetensors_config(files):
    """The F32 file's ModelConfig is the safetensors checkpoint's, field for field (layer kinds,
    window, both RoPE bases, scaling, attention scale, soft cap); transformers' GGUF reader finds
    the same layer kinds, window and local base, and the checkpoint's weights (its -1 undoes the +1)."""
    from safetensors.torch import load_file

    from ferrylm.model.loaders.gguf_loader import GGUFFile, load_gguf_config
    from ferrylm.model.loaders.hf_loader import load_hf_config

    want = load_hf_config(files["hf"], "g")
    got = load_gguf_config(GGUFFile(files["f32"]), "g")
    assert got.sliding_layers == (0, 1, 2, 3, 4) and got.query_pre_attn_scalar == 256
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)  # float32 in the file
    assert dataclasses.asdict(dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps)) == dataclasses.asdict(want)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(files["f32"].parent), gguf_file=files["f32"].name,
                                                            dtype=torch.float32)
    hf_config = _hf_model(files["hf"]).config
    assert ref.config.layer_types == hf_config.layer_types and ref.config.sliding_window == 8
    assert ref.config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert ref.config.query_pre_attn_scalar == ref.config.head_dim == 256
    weights = load_file(str(files["hf"] / "model.safetensors"))
    state = ref.state_dict()
    for name, w in weights.items():
        assert torch.allclose(state[name], w, atol=1e-6, rtol=0), name


def test_f32_gguf_greedy_equals_transformers(files):
    directory = files["hf"]
    model = _hf_model(directory)
    reference = [_greedy_reference(model, p) for p in PROMPTS]
    llm, outs = _generate(files["f32"], directory)
    assert llm.engine.executor.model.config.architecture == "gemma3"
    assert outs[1].num_cached_tokens >= 16  # the shared prefix came from the cache
    _assert_greedy_equal(outs, reference, 1e-4)


def test_quantized_gguf_is_kept_packed_and_equals_its_dequantized_weights(files):
    from ferrylm.model.quant.packed import PackedWeight, SegmentedWeight

    reference = [_greedy_reference(_hf_model(files["twin"]), p) for p in PROMPTS]
    llm, outs = _generate(files["q"], files["hf"])
    model = llm.engine.executor.model
    assert model.lm_head.quant.name == "gguf"  # the tied Q8_0 embedding, packed
    assert isinstance(model.layers[5].self_attn.qkv_proj.packed, SegmentedWeight)  # Q4_0 | Q4_1 | Q8_0
    assert isinstance(model.layers[0].mlp.down_proj.packed, PackedWeight)
    _assert_greedy_equal(outs, reference, 1e-3)


def test_gguf_layer_kinds_and_load_errors(tmp_path):
    """llama.cpp's rules on metadata alone: no window, no sliding layer; a sliding_window_pattern
    (period or per-layer bools) and rope.freq_base_swa override the fixed 6 and 10000; the 62-layer
    model (27B) scales attention by hidden / heads; attn_logit_softcapping is a load error."""
    from ferrylm.model.loaders.gguf_loader import GGUFFile, load_gguf_config
    from ferrylm.model.loaders.model_source import ModelLoadError

    def config(name: str, layers: int = 4, **keys):
        path = tmp_path / f"{name}.gguf"
        writer = gguf.GGUFWriter(str(path), "gemma3")
        for add, value in [(writer.add_block_count, layers), (writer.add_embedding_length, 5376),
                           (writer.add_head_count, 32), (writer.add_key_length, 128), (writer.add_vocab_size, 8)]:
            add(value)
        for key, value in keys.items():
            getattr(writer, f"add_{key}")(value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return load_gguf_config(GGUFFile(path), name)

    full = config("full")
    assert (full.sliding_window, full.sliding_layers, full.query_pre_attn_scalar) == (None, (), 128)
    assert config("six", layers=8, sliding_window=512).sliding_layers == (0, 1, 2, 3, 4, 6, 7)
    assert config("period", sliding_window=512, sliding_window_pattern=2).sliding_layers == (0, 2)
    bools = config("bools", sliding_window=512, sliding_window_pattern=[True, False, False, True],
                   rope_freq_base_swa=500.0)
    assert (bools.sliding_layers, bools.local_rope_theta) == ((0, 3), 500.0)
    assert config("27b", layers=62).query_pre_attn_scalar == 168
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        config("capped", attn_logit_softcapping=50.0)
