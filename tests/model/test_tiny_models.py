"""Our paged-KV model vs transformers on tiny random Llama, Qwen2, Qwen3 and Mistral checkpoints."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.loaders.model_source import resolve_model
from tests.model.tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")

BLOCK = 16


def _ours(directory, fast: bool = False):
    """Our model on `directory`: torch-native (the oracle) or the CPU fast path (C++ kernels)."""
    from ferrylm.model.attention import AttentionSpec, select_backend
    from ferrylm.model.attention.cpu import cpu_fused_ops

    checkpoint = Checkpoint(resolve_model(str(directory)))
    cpu = torch.device("cpu")
    spec = AttentionSpec.for_model(checkpoint.config, BLOCK, torch.float32, cpu)
    backend = select_backend(spec, "auto" if fast else "torch")
    model = load_model(checkpoint, torch.float32, cpu, backend, fused_ops=cpu_fused_ops(cpu) if fast else None)
    cfg = checkpoint.config
    caches = [(torch.zeros(64, BLOCK, cfg.num_kv_heads, cfg.head_dim), torch.zeros(64, BLOCK, cfg.num_kv_heads,
               cfg.head_dim)) for _ in range(cfg.num_layers)]
    return model, caches


def _reference_logits(directory, prompt: list[int]) -> torch.Tensor:
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("fast", [False, True], ids=["torch-native", "cpu-kernels"])
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe", "llama4",
                                  "mistral"])
def test_varlen_batch_matches_transformers(kind, fast, tmp_path):
    directory = make_tiny_model(kind, tmp_path / kind)
    model, caches = _ours(directory, fast)
    gen = torch.Generator().manual_seed(1)
    lengths = [5, 37, 70, 1]  # span 1..5 blocks, including a partial last block
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]
    # Disjoint block tables, deliberately out of order, so a wrong slot mapping cannot pass.
    tables, next_block = [], 63
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(list(range(next_block, next_block - need, -1)))
        next_block -= need
    # Step 1: prefill the first part of each prompt; step 2: the rest (chunked prefill + decode rows).
    split = [max(1, n - 20) for n in lengths]
    with torch.no_grad():
        b1 = ForwardBatch.build([p[:s] for p, s in zip(prompts, split)], [0] * 4, tables, BLOCK,
                                logits_rows=[])
        h1 = model(b1, caches)
        rest = [p[s:] for p, s in zip(prompts, split)]
        keep = [i for i, r in enumerate(rest) if r]
        b2 = ForwardBatch.build([rest[i] for i in keep], [split[i] for i in keep], [tables[i] for i in keep], BLOCK)
        h2 = model(b2, caches)
    for i, prompt in enumerate(prompts):
        expected = _reference_logits(directory, prompt)
        start1 = b1.query_start_loc[i].item()
        ours = [model.compute_logits(h1[start1:start1 + split[i]])]
        if i in keep:
            j = keep.index(i)
            s2, e2 = b2.query_start_loc[j].item(), b2.query_start_loc[j + 1].item()
            ours.append(model.compute_logits(h2[s2:e2]))
        got = torch.cat(ours)
        assert got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        assert diff < 1e-4, f"{kind} prompt {i}: max |diff| {diff}"


def test_qwen2_has_qkv_bias_loaded(tmp_path):
    directory = make_tiny_model("qwen2", tmp_path / "q")
    model, _ = _ours(directory)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


def test_sharded_checkpoint_loads(tmp_path):
    directory = make_tiny_model("llama", tmp_path / "sharded", shard_size="60KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 1
    model, caches = _ours(directory)
    prompt = list(range(3, 40))
    with torch.no_grad():
        b = ForwardBatch.build([prompt], [0], [[0, 1, 2]], BLOCK)
        got = model.compute_logits(model(b, caches)[b.logits_indices])[0]
    assert (got - _reference_logits(directory, prompt)[-1]).abs().max().item() < 1e-4


def _finish(writer) -> None:
    """Write a GGUFWriter's header, metadata and tensors, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}  # llama.cpp's names of an untied model's outer tensors


def _put(writer, name: str, tensor: torch.Tensor, kind) -> None:
    """One tensor into a GGUFWriter: 1-D ones (norms) in F32, the others in block type `kind`."""
    import gguf

    array = tensor.float().contiguous().numpy()
    if tensor.dim() < 2 or kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)


def _gguf_matches_transformers(tmp_path, kind: str, write, check_config) -> None:
    """The tiny `kind` model written as GGUF by `write(path, directory, block type)` in F32 gives
    transformers' logits on the same weights (1e-4), in Q8_0 (blocks kept packed) within quantization
    error (5e-2); `check_config(model.config)` asserts what the file's metadata must have become."""
    gguf = pytest.importorskip("gguf")
    directory = make_tiny_model(kind, tmp_path / kind)
    prompt = list(range(3, 60))
    expected = _reference_logits(directory, prompt)
    for name, block, tol in [("f32", gguf.GGMLQuantizationType.F32, 1e-4),
                             ("q8", gguf.GGMLQuantizationType.Q8_0, 5e-2)]:
        path = tmp_path / f"{name}.gguf"
        write(path, directory, block)
        model, caches = _ours(path, fast=True)
        check_config(model.config)
        with torch.no_grad():
            got = model.compute_logits(model(ForwardBatch.build([prompt], [0], [list(range(4))], BLOCK), caches))
        assert (got - expected).abs().max().item() < tol * max(1.0, expected.abs().max().item()), name


def _write_qwen3_gguf(path, directory, kind_of) -> None:
    """The tiny Qwen3's weights as a llama.cpp-style "qwen3" GGUF (q/k not permuted, per-head q/k
    norms as attn_q_norm / attn_k_norm); `kind_of(gguf_name)` picks each 2-D tensor's block format."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    T = gguf.GGMLQuantizationType
    weights = load_file(str(directory / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "qwen3")
    for add, value in [(writer.add_context_length, 512), (writer.add_embedding_length, 64), (writer.add_block_count, 2),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_head_count_kv, 2), (writer.add_key_length, 32), (writer.add_value_length, 32),
                       (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_vocab_size, 320), (writer.add_eos_token_id, 2)]:
        add(value)

    def put(name: str, tensor: torch.Tensor) -> None:
        array, kind = tensor.float().numpy(), (kind_of(name) if tensor.dim() == 2 else T.F32)
        if kind == T.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(2):
        for gguf_name, hf_name in names.items():
            put(f"blk.{i}.{gguf_name}.weight", weights[f"model.layers.{i}.{hf_name}.weight"])
    _finish(writer)


def test_qwen3_gguf_matches_transformers(tmp_path):
    """A "qwen3" GGUF in float32 gives transformers' logits on the same weights; with Q8_0 linears
    (kept packed) the logits stay within quantization error of them."""
    def check(cfg):
        assert cfg.architecture == "qwen3" and cfg.head_dim == 32

    _gguf_matches_transformers(tmp_path, "qwen3", lambda p, d, k: _write_qwen3_gguf(p, d, lambda _: k), check)


def _write_phi3_gguf(path, directory, kind) -> None:
    """The tiny Phi-3's weights as llama.cpp's converter writes a "phi3" GGUF: fused attn_qkv and
    ffn_up (= gate_up_proj) kept fused, rope.dimension_count the partial rotary width, and the
    sliding window key llama.cpp reads and ignores."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    weights = load_file(str(directory / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "phi3")
    for add, value in [(writer.add_context_length, 512), (writer.add_embedding_length, 64), (writer.add_block_count, 2),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_head_count_kv, 2), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_rope_dimension_count, 8),
                       (writer.add_sliding_window, 256), (writer.add_vocab_size, 320), (writer.add_eos_token_id, 2)]:
        add(value)

    def put(name: str, tensor: torch.Tensor) -> None:
        _put(writer, name, tensor, kind)

    for name, hf_name in GLOBAL_TENSORS.items():
        put(name, weights[hf_name])
    names = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(2):
        for gguf_name, hf_name in names.items():
            put(f"blk.{i}.{gguf_name}.weight", weights[f"model.layers.{i}.{hf_name}.weight"])
    _finish(writer)


def test_phi3_gguf_matches_transformers(tmp_path):
    """A "phi3" GGUF (fused qkv / gate_up, partial RoPE) in float32 gives transformers' logits on the
    same weights; with Q8_0 blocks (kept packed, the fused rows sliced) within quantization error."""
    def check(cfg):
        assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_layers, cfg.max_position_embeddings) == \
            ("phi3", 8, (), 512)

    _gguf_matches_transformers(tmp_path, "phi3", _write_phi3_gguf, check)


def test_phi3_gguf_with_longrope_factors_is_a_load_error_naming_them(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from ferrylm.model.loaders.model_source import ModelLoadError

    directory = make_tiny_model("phi3", tmp_path / "phi3")
    path = tmp_path / "longrope.gguf"
    _write_phi3_gguf(path, directory, gguf.GGMLQuantizationType.F32)
    patched = tmp_path / "patched.gguf"
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(patched), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("phi3.") or field.name == "tokenizer.ggml.eos_token_id":
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("rope_factors_long.weight", np.ones(4, dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        _ours(patched)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert script's Q/K row permutation for the "llama" arch (rotate-half → interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_llama4_gguf(path, directory, kind) -> None:
    """The tiny Llama 4 as llama.cpp's converter (Llama4Model) writes it: q/k rows as stored (Meta's
    interleaved pairs, undo_permute False), each MoE layer's fused experts split and transposed into
    stacked ffn_{gate,up,down}_exps, the router and the shared expert under their llama.cpp names."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    w = load_file(str(directory / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama4")
    for add, value in [(writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 4), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_freq_base, 500000.0), (writer.add_rope_dimension_count, 16),
                       (writer.add_expert_count, 4), (writer.add_expert_used_count, 1),
                       (writer.add_expert_feed_forward_length, 64), (writer.add_interleave_moe_layer_step, 2),
                       (writer.add_vocab_size, 320)]:
        add(value)

    def put(name: str, tensor: torch.Tensor) -> None:
        _put(writer, name, tensor, kind)

    for name, hf_name in GLOBAL_TENSORS.items():
        put(name, w[hf_name])
    for i in range(4):
        p = f"model.layers.{i}."
        for g, h in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.o_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")]:
            put(f"blk.{i}.{g}.weight", w[p + h + ".weight"])
        if i % 2 == 0:  # dense
            for g in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{g}.weight", w[f"{p}feed_forward.{g}_proj.weight"])
            continue
        gate, up = w[p + "feed_forward.experts.gate_up_proj"].transpose(-1, -2).split(64, dim=-2)
        put(f"blk.{i}.ffn_gate_exps.weight", gate)
        put(f"blk.{i}.ffn_up_exps.weight", up)
        put(f"blk.{i}.ffn_down_exps.weight", w[p + "feed_forward.experts.down_proj"].transpose(-1, -2))
        put(f"blk.{i}.ffn_gate_inp.weight", w[p + "feed_forward.router.weight"])
        for g in ("gate", "up", "down"):
            put(f"blk.{i}.ffn_{g}_shexp.weight", w[f"{p}feed_forward.shared_expert.{g}_proj.weight"])
    _finish(writer)


def test_llama4_gguf_matches_transformers(tmp_path):
    """A "llama4" GGUF (interleaved dense/MoE layers, sigmoid top-1 router, shared expert, NoPE layer
    3, L2 q/k norm, all rebuilt from llama.cpp's conventions) in float32 gives transformers' logits;
    with Q8_0 blocks, within quantization error, experts kept packed."""
    def check(cfg):
        assert (cfg.architecture, cfg.moe_layers, cfg.nope_layers, cfg.qk_l2_norm, cfg.moe_router,
                cfg.shared_expert_intermediate_size, cfg.max_position_embeddings) == \
            ("llama4", (1, 3), (3,), True, "sigmoid", 64, 512)

    _gguf_matches_transformers(tmp_path, "llama4", _write_llama4_gguf, check)


def _llama3_rope_freqs(theta: float, head_dim: int, scaling: dict) -> list[float]:
    """The rope_freqs factors llama.cpp's converter (LlamaModel.generate_extra_tensors) writes for
    Llama 3.1-style scaling: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """A Llama 3.1-style GGUF as llama.cpp writes it (q/k rows permuted, tied embeddings, no
    rope_scaling keys but a rope_freqs tensor): transformers' logits over 300 positions, which the
    scaled frequencies change (the file without its factors does not match)."""
    gguf = pytest.importorskip("gguf")
    import json

    import numpy as np
    from safetensors.torch import load_file

    directory = make_tiny_model("llama3", tmp_path / "llama3")
    hf = json.loads((directory / "config.json").read_text())
    scaling = hf.get("rope_scaling") or hf["rope_parameters"]
    theta = hf.get("rope_theta") or scaling["rope_theta"]
    weights = load_file(str(directory / "model.safetensors"))
    prompt = [3 + (7 * j) % 300 for j in range(300)]
    expected = _reference_logits(directory, prompt)

    def write(path, factors):
        writer = gguf.GGUFWriter(str(path), "llama")
        for add, value in [(writer.add_context_length, 512), (writer.add_embedding_length, 64),
                           (writer.add_block_count, 2), (writer.add_feed_forward_length, 128),
                           (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
                           (writer.add_layer_norm_rms_eps, 1e-6), (writer.add_rope_freq_base, theta),
                           (writer.add_rope_dimension_count, 16), (writer.add_vocab_size, 320)]:
            add(value)
        if factors is not None:
            writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
        writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"].numpy())
        writer.add_tensor("output_norm.weight", weights["model.norm.weight"].numpy())
        names = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                 "ffn_norm": "post_attention_layernorm"}
        for i in range(2):
            p = f"model.layers.{i}."
            for g, h, heads in [("attn_q", "self_attn.q_proj", 4), ("attn_k", "self_attn.k_proj", 2)]:
                writer.add_tensor(f"blk.{i}.{g}.weight", _llama_cpp_permute(weights[p + h + ".weight"], heads).numpy())
            for g, h in names.items():
                writer.add_tensor(f"blk.{i}.{g}.weight", weights[p + h + ".weight"].numpy())
        _finish(writer)

    batch = ForwardBatch.build([prompt], [0], [list(range(19))], BLOCK)
    errors = {}
    for name, factors in [("rope_freqs", _llama3_rope_freqs(theta, 16, scaling)), ("without", None)]:
        path = tmp_path / f"{name}.gguf"
        write(path, factors)
        model, caches = _ours(path, fast=True)
        with torch.no_grad():
            got = model.compute_logits(model(batch, caches))
        errors[name] = (got - expected).abs().max().item() / max(1.0, expected.abs().max().item())
    assert errors["rope_freqs"] < 1e-4 and errors["without"] > 1e-3, errors  # measured: 2.6e-7, 2.7e-3


def test_gguf_rope_freqs_of_the_wrong_length_is_a_load_error(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from ferrylm.model.loaders.model_source import ModelLoadError

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(writer.add_context_length, 64), (writer.add_embedding_length, 64), (writer.add_block_count, 1),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4),
                       (writer.add_head_count_kv, 2), (writer.add_vocab_size, 32)]:
        add(value)
    for name, factors in [("rope_freqs.weight", np.ones(5, dtype=np.float32)),
                          ("token_embd.weight", np.zeros((32, 64), dtype=np.float32))]:
        writer.add_tensor(name, factors)
    _finish(writer)
    with pytest.raises(ModelLoadError, match="rope_freqs.weight.*8 finite positive"):
        _ours(path)


def _write_moe_gguf(path, weights: dict, kind, arch: str, experts: int, width: int, rope_theta: float) -> None:
    """A tiny MoE as llama.cpp writes it: `arch` "qwen3moe" (q/k norms, head_dim 32) or "llama"
    (Mixtral: q/k rows permuted, an output matrix); experts stacked in ffn_{gate,up,down}_exps
    [E, rows, cols], the router as ffn_gate_inp; linears in `kind`."""
    gguf = pytest.importorskip("gguf")
    T = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = 32 if arch == "qwen3moe" else 16
    for add, value in [(writer.add_context_length, 512), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 2), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_key_length, head_dim),
                       (writer.add_value_length, head_dim), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_freq_base, rope_theta), (writer.add_vocab_size, 320),
                       (writer.add_expert_count, experts), (writer.add_expert_used_count, 2),
                       (writer.add_expert_feed_forward_length, width)]:
        add(value)

    def put(gguf_name: str, tensor: torch.Tensor, quantize: bool = False) -> None:
        array = tensor.float().numpy()
        if quantize and kind != T.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"], quantize=True)
    for i in range(2):
        p = f"model.layers.{i}."
        q, k = weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = _llama_cpp_permute(q, 4), _llama_cpp_permute(k, 2)
        put(f"blk.{i}.attn_q.weight", q, quantize=True)
        put(f"blk.{i}.attn_k.weight", k, quantize=True)
        put(f"blk.{i}.attn_v.weight", weights[p + "self_attn.v_proj.weight"], quantize=True)
        put(f"blk.{i}.attn_output.weight", weights[p + "self_attn.o_proj.weight"], quantize=True)
        norms = [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                 ("ffn_gate_inp", "mlp.gate")]
        if arch == "qwen3moe":
            norms += [("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]
        for g, h in norms:
            put(f"blk.{i}.{g}.weight", weights[p + h + ".weight"])
        for g, h in [("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")]:
            put(f"blk.{i}.{g}.weight",
                torch.stack([weights[f"{p}mlp.experts.{e}.{h}.weight"] for e in range(experts)]), quantize=True)
    _finish(writer)


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"], ids=["qwen3moe", "mixtral-as-llama"])
def test_moe_gguf_matches_transformers(tmp_path, arch):
    """llama.cpp's MoE GGUF layouts of the tiny Qwen3-MoE (every layer sparse, top-k renormalised, as
    llama.cpp builds it) and the tiny Mixtral (arch "llama" with expert_count, q/k rows permuted):
    f32 gives transformers' logits; Q8_0 experts stay packed, one PackedWeight per expert, and give
    the logits of the same file dequantized."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from ferrylm.config import QuantConfig
    from ferrylm.model.loaders.hf_loader import canonical_weights, load_hf_config
    from ferrylm.model.quant.packed import PackedWeight

    if arch == "qwen3moe":
        directory = make_tiny_model("qwen3_moe", tmp_path / "moe", mlp_only_layers=[], norm_topk_prob=True,
                                    moe_intermediate_size=64)  # Q8_0 rows: a multiple of 32
        experts, width, want_arch = 6, 64, "qwen3_moe"
    else:
        directory = make_tiny_model("mixtral", tmp_path / "moe")
        experts, width, want_arch = 4, 128, "mixtral"
    # Mixtral's block_sparse_moe.experts.E.w1/w2/w3 under the names the writer reads
    config = load_hf_config(directory, "moe")
    weights = dict(canonical_weights(iter(load_file(str(directory / "model.safetensors")).items()), config))
    prompt = list(range(3, 60))
    expected = _reference_logits(directory, prompt)
    T = gguf.GGMLQuantizationType
    batch = ForwardBatch.build([prompt], [0], [list(range(4))], BLOCK)
    for name, kind in [("f32", T.F32), ("q8", T.Q8_0)]:
        path = tmp_path / f"{name}.gguf"
        _write_moe_gguf(path, weights, kind, arch, experts, width, config.rope_theta)
        model, caches = _ours(path, fast=True)
        assert model.config.architecture == want_arch and model.config.num_experts == experts
        with torch.no_grad():
            got = model.compute_logits(model(batch, caches))
        if kind == T.F32:  # the same weights: transformers' logits
            assert (got - expected).abs().max().item() < 1e-4 * max(1.0, expected.abs().max().item())
            continue
        # Q8_0: every expert kept packed, computing what the file's blocks dequantize to
        assert isinstance(model.layers[1].mlp.experts[experts - 1].down_proj.packed, PackedWeight)
        twin = load_model(Checkpoint(resolve_model(str(path))), torch.float32, torch.device("cpu"),
                          model.attn_backend, quantization=QuantConfig("none"))
        with torch.no_grad():
            want = twin.compute_logits(twin(batch, caches))
        assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_llama4_gguf_without_experts_is_a_load_error_naming_the_key(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from ferrylm.model.loaders.model_source import ModelLoadError

    path = tmp_path / "dense.gguf"
    writer = gguf.GGUFWriter(str(path), "llama4")
    for add, value in [(writer.add_context_length, 64), (writer.add_embedding_length, 64), (writer.add_block_count, 1),
                       (writer.add_feed_forward_length, 128), (writer.add_head_count, 4), (writer.add_vocab_size, 32)]:
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    _finish(writer)
    with pytest.raises(ModelLoadError, match="llama4.expert_count"):
        _ours(path)
