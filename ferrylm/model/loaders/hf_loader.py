"""Hugging Face model directories: config.json → ModelConfig, safetensors shards → named tensors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ferrylm.config import ModelConfig
from ferrylm.model.arch.layers import ROPE_TYPES
from ferrylm.model.loaders.gemma3_config import TEXT_DEFAULTS as GEMMA3_TEXT_DEFAULTS
from ferrylm.model.loaders.gemma3_config import gemma3_fields, gemma3_rope
from ferrylm.model.loaders.int4_checkpoint import read_quantization_config
from ferrylm.model.loaders.model_source import ModelLoadError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",  # its text model; the vision tower is not loaded
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model; the vision tower is not loaded
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def load_hf_config(directory: Path, name: str) -> ModelConfig:
    """Read config.json (and generation_config.json for EOS ids) into a ModelConfig."""
    cfg = read_json(directory / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(ARCHITECTURES)
        raise ModelLoadError(f"{directory / 'config.json'}: unsupported architecture {archs} (supported: {supported})")
    where = str(directory / "config.json")
    if "text_config" in cfg:  # a multimodal checkpoint (Llama 4, Gemma 3): serve its language model
        text = {**GEMMA3_TEXT_DEFAULTS, **cfg["text_config"]} if arch == "gemma3" else cfg["text_config"]
        cfg = {**text, "quantization_config": cfg.get("quantization_config")}
    gen_path = directory / "generation_config.json"
    gen = read_json(gen_path) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta, scaling and partial factor here
    if arch == "gemma3":  # RoPE per layer type
        rope_theta, scaling, _ = gemma3_rope(cfg, where)
        rope = {}
    else:
        rope_theta, scaling = cfg.get("rope_theta", rope.get("rope_theta", 10000.0)), cfg.get("rope_scaling") or rope
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES:
        raise ModelLoadError(f"{where}: rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r} is not "
                             f"supported (supported: {', '.join(ROPE_TYPES)})")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    int4 = read_quantization_config(cfg, where)
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    fields = dict(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size_mlp"] if arch == "llama4" else cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
        max_position_embeddings=_full_attention_span(cfg, arch),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        **_experts(cfg, arch),
        prequantized=None if int4 is None else int4.method,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
        eos_token_ids=eos_ids,
        name=name,
    )
    sliding = gemma3_fields(cfg, where) if arch == "gemma3" else _sliding_fields(cfg, arch, where)
    return ModelConfig(**{**fields, **sliding})


def _experts(cfg: dict, arch: str) -> dict:
    """ModelConfig's mixture-of-experts fields: Mixtral's every layer, top-k renormalised; Qwen3-MoE's
    layers per decoder_sparse_step minus mlp_only_layers, renormalised as norm_topk_prob says."""
    if arch == "mixtral":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    if arch == "llama4":  # interleaved dense/MoE layers, top-k sigmoid router scaling the input, a shared expert
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], moe_router="sigmoid",
                    shared_expert_intermediate_size=cfg["intermediate_size"],
                    moe_layers=tuple(cfg.get("moe_layers") or range(
                        cfg.get("interleave_moe_layer_step", 1) - 1, cfg["num_hidden_layers"],
                        cfg.get("interleave_moe_layer_step", 1))),
                    nope_layers=tuple(i for i, rope in enumerate(cfg.get("no_rope_layers") or ()) if not rope),
                    qk_l2_norm=bool(cfg.get("use_qk_norm", False)))
    if arch == "qwen3_moe":
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        return dict(num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                    num_experts_per_tok=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=layers)
    return {}


def _full_attention_span(cfg: dict, arch: str) -> int:
    """The context the model serves: max_position_embeddings (sliding windows are real attention
    windows, see _sliding_fields); Llama 4's is cut where its chunked attention and NoPE temperature
    tuning would start, which are not built."""
    span = cfg.get("max_position_embeddings", 2048)
    if arch == "llama4":
        span = min(span, cfg.get("attention_chunk_size") or span,
                   cfg.get("floor_scale", span + 1) - 1 if cfg.get("attn_temperature_tuning") else span)
    return span


def _sliding_fields(cfg: dict, arch: str, where: str) -> dict:
    """Sliding-window attention as transformers runs it: Mistral, Mixtral and Phi-3 slide every layer
    when `sliding_window` is set; Qwen2/Qwen3 only with `use_sliding_window`, on the layers
    `layer_types` names (else those from `max_window_layers` on), Qwen3-MoE then on every layer. A
    query at p sees keys p - window + 1 .. p; older KV blocks are kept, masked (every backend)."""
    window = cfg.get("sliding_window")
    qwen = arch in ("qwen2", "qwen3", "qwen3_moe")
    if (arch not in ("mistral", "mixtral", "phi3") and not qwen) or window is None:
        return {}
    if qwen and not cfg.get("use_sliding_window", False):
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer or null, not {window!r}")
    layers = cfg["num_hidden_layers"]
    if arch in ("qwen2", "qwen3"):
        kinds = cfg.get("layer_types")
        if kinds is not None:
            if not isinstance(kinds, list) or len(kinds) != layers or \
                    not set(kinds) <= {"sliding_attention", "full_attention"}:
                raise ModelLoadError(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' "
                                     f"for each of the {layers} layers")
            sliding = tuple(i for i, k in enumerate(kinds) if k == "sliding_attention")
        else:
            sliding = tuple(range(cfg.get("max_window_layers", 28), layers))
    else:
        sliding = tuple(range(layers))
    if window >= cfg.get("max_position_embeddings", 2048) or not sliding:
        return {}  # the window never cuts anything: every layer attends fully
    return {"sliding_window": window, "sliding_layers": sliding}


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        files = [directory / n for n in names]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: missing (listed in model.safetensors.index.json)")
    return files


def iter_hf_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) from every shard, one tensor at a time."""
    from safetensors import SafetensorError, safe_open

    for path in _shard_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({e})") from None


_MIXTRAL_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.weight")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name as loading knows it (Mixtral's experts and Llama 4's feed_forward
    renamed; others as they are)."""
    name = name.removeprefix("language_model.")  # Llama 4's, transformers 4's Gemma 3 multimodal
    if name.startswith("model.language_model."):  # transformers 5's Gemma3ForConditionalGeneration
        name = "model." + name.removeprefix("model.language_model.")
    if ".feed_forward." in name:  # Llama 4
        name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
    m = _MIXTRAL_EXPERT.fullmatch(name)
    if not m:
        return name
    part = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), _MIXTRAL_PROJ[m.group(3)])
    return f"{m.group(1)}.mlp.{part}.weight"


def canonical_weights(weights: Iterator[tuple[str, Any]], config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors under the one naming loading, quantization and tensor-parallel sharding
    know: a fused `qkv_proj` / `gate_up_proj` (Phi-3) split into q/k/v and gate/up, Mixtral's
    `block_sparse_moe.{gate, experts.E.w1/w2/w3}` as `mlp.{gate, experts.E.gate/down/up_proj}`."""
    llama4 = config.architecture == "llama4"
    for name, tensor in weights:
        if llama4:
            yield from _llama4_weights(canonical_name(name), tensor, config)
            continue
        if not isinstance(tensor, torch.Tensor) and name.endswith(FUSED_SUFFIXES):
            raise ModelLoadError(f"{name}: a quantized fused projection is not supported")
        name = canonical_name(name)
        parts = fused_rows(name, tensor.shape[0], config, name) if name.endswith(FUSED_SUFFIXES) else None
        if parts is None:
            yield name, tensor
        else:
            yield from ((part, tensor[start:end]) for part, start, end in parts)


FUSED_SUFFIXES = (".qkv_proj.weight", ".gate_up_proj.weight")


def fused_rows(name: str, rows: int, config: ModelConfig, where: str) -> list[tuple[str, int, int]]:
    """A fused Phi-3 projection (`qkv_proj`: q, k, v rows; `gate_up_proj`: gate, up rows, as
    transformers' Phi3MLP and llama.cpp's converter lay them out) as (projection name, first row, end
    row) each; a ModelLoadError when its `rows` are not what the parts add up to."""
    q, kv, ff = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    if name.endswith(".qkv_proj.weight"):
        base, sizes = name.removesuffix("qkv_proj.weight"), [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
    else:
        base, sizes = name.removesuffix("gate_up_proj.weight"), [("gate_proj", ff), ("up_proj", ff)]
    if rows != sum(n for _, n in sizes):
        raise ModelLoadError(f"{where}: {name} has {rows} rows, not the {' + '.join(str(n) for _, n in sizes)} its "
                             "fused projections need")
    parts, start = [], 0
    for proj, n in sizes:
        parts.append((f"{base}{proj}.weight", start, start + n))
        start += n
    return parts


def _llama4_weights(name: str, tensor: Any, config: ModelConfig) -> Iterator[tuple[str, Any]]:
    """Llama 4's tensors as the loader knows them: the fused experts [E, H, 2I] / [E, I, H] as each
    expert's gate/up/down [out, in]; q/k rows from Meta's interleaved RoPE pairs to rotate-half (the
    same permutation for q and k keeps every dot product; the L2 q/k norm ignores the order)."""
    from ferrylm.model.loaders.gguf_loader import unpermute_qk

    if name.endswith(".mlp.experts.gate_up_proj"):
        base = name.removesuffix("gate_up_proj")
        for e, w in enumerate(tensor):
            gate, up = w.t().chunk(2)
            yield f"{base}{e}.gate_proj.weight", gate.contiguous()
            yield f"{base}{e}.up_proj.weight", up.contiguous()
    elif name.endswith(".mlp.experts.down_proj"):
        base = name.removesuffix("down_proj")
        for e, w in enumerate(tensor):
            yield f"{base}{e}.down_proj.weight", w.t().contiguous()
    elif name.endswith(".self_attn.q_proj.weight"):
        yield name, unpermute_qk(tensor, config.num_heads)
    elif name.endswith(".self_attn.k_proj.weight"):
        yield name, unpermute_qk(tensor, config.num_kv_heads)
    else:
        yield name, tensor
