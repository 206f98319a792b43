"""Safetensors checkpoints quantized on load (int8, int4), on the tiny random Llama / Qwen2 / Llama-3
models: the quantized model is the float model with its weights replaced by their dequantized values.

Oracle: load the same checkpoint unquantized, overwrite every Linear weight with the quantized
layer's dequantize(), and compare logits (fp32, tolerance 1e-4 of the logits' magnitude). Tied
embeddings (llama3, qwen2) read the quantized LM head's rows: no float table is kept.
"""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import QuantConfig
from ferrylm.model.arch.layers import Linear
from ferrylm.model.attention.torch_native import TorchNativeBackend
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.loaders.model_source import resolve_model
from tests.model.tiny_models import make_tiny_model

BLOCK = 16


def _load(directory, quantization: str | None):
    quant = None if quantization is None else QuantConfig.parse(quantization)
    return load_model(Checkpoint(resolve_model(str(directory))), torch.float32, torch.device("cpu"),
                      TorchNativeBackend(), quantization=quant)


def _logits(model, prompt: list[int]) -> torch.Tensor:
    cfg = model.config
    caches = [(torch.zeros(8, BLOCK, cfg.num_kv_heads, cfg.head_dim), torch.zeros(8, BLOCK, cfg.num_kv_heads,
               cfg.head_dim)) for _ in range(cfg.num_layers)]
    with torch.inference_mode():
        hidden = model(ForwardBatch.build([prompt], [0], [list(range(8))], BLOCK), caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
@pytest.mark.parametrize("quantization", ["int8", "int4", "int4-g64"])
def test_quantized_on_load_equals_float_model_with_dequantized_weights(kind, quantization, tmp_path):
    directory = make_tiny_model(kind, tmp_path / kind)
    quantized = _load(directory, quantization)
    oracle = _load(directory, None)
    names = {name: m for name, m in quantized.named_modules() if isinstance(m, Linear)}
    with torch.no_grad():
        for name, module in oracle.named_modules():
            if isinstance(module, Linear):
                q = names[name]
                assert q.quant.name != "none" and not hasattr(q, "weight")
                module.weight.copy_(q.quant.dequantize(q))  # tied: also the oracle's embedding table
    prompt = list(range(3, 40))
    got, ref = _logits(quantized, prompt), _logits(oracle, prompt)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    float_logits = _logits(_load(directory, None), prompt)
    assert (got - float_logits).abs().max() <= 0.25 * float_logits.abs().max()  # and still close to float
    if quantized.config.tie_word_embeddings:
        assert quantized.embed_tokens is None
        ids = torch.tensor([0, 7, 319])
        assert torch.equal(quantized.embed(ids), quantized.lm_head.quant.dequantize(quantized.lm_head)[ids])


def test_int4_keeps_an_int8_lm_head(tmp_path):
    model = _load(make_tiny_model("llama3", tmp_path / "l3"), "int4")
    assert model.layers[0].mlp.down_proj.quant.name == "int4"
    assert model.lm_head.quant.name == "int8"


def test_quantization_reaches_the_runner(tmp_path, monkeypatch):
    """LLM(quantization=...) → EngineConfig → Engine.from_config → ModelRunner → load_model."""
    from ferrylm import LLM
    from ferrylm.config import CacheConfig
    from ferrylm.engine.engine import Engine
    from ferrylm.model.runner import ModelRunner

    seen = []
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, config: seen.append(config) or None))
    LLM("smollm2-135m", quantization="int4-g64")
    assert seen[0].quant == QuantConfig("int4", 64)

    directory = make_tiny_model("llama", tmp_path / "llama")
    checkpoint = Checkpoint(resolve_model(str(directory)))
    runner = ModelRunner(checkpoint, CacheConfig(num_blocks=8), torch.float32, torch.device("cpu"), 64,
                         enforce_eager=True, quantization=QuantConfig.parse("int8"))
    assert runner.model.layers[0].self_attn.qkv_proj.quant.name == "int8"
    default = ModelRunner(checkpoint, CacheConfig(num_blocks=8), torch.float32, torch.device("cpu"), 64,
                          enforce_eager=True)
    assert default.model.lm_head.quant.name == "none"  # safetensors default: unquantized


def _write_tiny_gguf(path, directory) -> None:
    """The tiny llama's weights as a GGUF file: q / k / v in three different block formats (one packed
    projection, three layouts), other linears Q8_0, an untied Q4_0 output, a Q8_0 embedding."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    T = gguf.GGMLQuantizationType
    weights = load_file(str(directory / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(320)
    writer.add_eos_token_id(2)

    def add(name: str, tensor: torch.Tensor, kind) -> None:
        array = tensor.float().numpy()
        if kind == T.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    add("token_embd.weight", weights["model.embed_tokens.weight"], T.Q8_0)
    add("output.weight", weights["lm_head.weight"], T.Q4_0)
    add("output_norm.weight", weights["model.norm.weight"], T.F32)
    kinds = {"attn_q": ("self_attn.q_proj", T.Q4_0), "attn_k": ("self_attn.k_proj", T.Q4_1),
             "attn_v": ("self_attn.v_proj", T.Q8_0), "attn_output": ("self_attn.o_proj", T.Q8_0),
             "ffn_gate": ("mlp.gate_proj", T.Q4_1), "ffn_up": ("mlp.up_proj", T.Q4_1),
             "ffn_down": ("mlp.down_proj", T.Q8_0), "attn_norm": ("input_layernorm", T.F32),
             "ffn_norm": ("post_attention_layernorm", T.F32)}
    for i in range(2):
        for gguf_name, (hf_name, kind) in kinds.items():
            add(f"blk.{i}.{gguf_name}.weight", weights[f"model.layers.{i}.{hf_name}.weight"], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_kept_packed_equals_dequantized(tmp_path, dtype):
    """A GGUF model kept packed (the default) against the same file dequantized at load: the same
    weight values, so fp32 logits agree to summation order; bf16 to bf16 rounding."""
    from ferrylm.model.quant.packed import SegmentedWeight

    directory = make_tiny_model("llama", tmp_path / "llama")
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, directory)
    checkpoint = Checkpoint(resolve_model(str(path)))

    def load(quantization):
        return load_model(checkpoint, dtype, torch.device("cpu"), TorchNativeBackend(),
                          quantization=None if quantization is None else QuantConfig.parse(quantization))

    packed, dequantized = load(None), load("none")
    assert packed.lm_head.quant.name == "gguf" and packed.embed_tokens is not None  # untied: a float table
    assert isinstance(packed.layers[0].self_attn.qkv_proj.packed, SegmentedWeight)
    prompt = list(range(3, 60))
    for rows in (prompt, prompt[:1]):
        cfg = packed.config
        got, ref = (m.compute_logits(m(ForwardBatch.build([rows], [0], [list(range(8))], BLOCK), [
            (torch.zeros(8, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
             torch.zeros(8, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)) for _ in range(cfg.num_layers)]))
            for m in (packed, dequantized))
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (got - ref).abs().max() <= tol * ref.abs().max()
