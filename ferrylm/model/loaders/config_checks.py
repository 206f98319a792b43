"""A checkpoint's ModelConfig checked before anything is built from it: a malformed config.json or GGUF
header is a ModelLoadError naming the field, never a ZeroDivisionError at load or a top-k IndexError at
the first decode step (which `ferrylm serve` would meet only when serving)."""

from __future__ import annotations

import math

from ferrylm.config import ModelConfig
from ferrylm.model.loaders.model_source import ModelLoadError

# ModelConfig's field → the name a Hugging Face config.json gives it (GGUF files: see gguf_loader.py)
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "num_experts": "num_local_experts / num_experts"}
POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "max_position_embeddings")
POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta")


def _name(field: str) -> str:
    return HF_NAMES.get(field, field)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_model_config(config: ModelConfig, where: str) -> ModelConfig:
    """`config`, or a ModelLoadError naming the first field the model cannot be built or run with."""
    for field in POSITIVE_INTS:
        if not _positive_int(getattr(config, field)):
            raise ModelLoadError(f"{where}: {_name(field)} must be a positive integer, not {getattr(config, field)!r}")
    for field in POSITIVE_FLOATS:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(f"{where}: {field} must be a positive number, not {value!r}")
    if config.num_heads % config.num_kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {config.num_heads} is not a multiple of "
                             f"num_key_value_heads {config.num_kv_heads}")
    rotary = config.rotary_dim or config.head_dim
    if not _positive_int(rotary) or rotary % 2 or rotary > config.head_dim:
        raise ModelLoadError(f"{where}: the rotary dimension {rotary!r} must be even and at most head_dim "
                             f"{config.head_dim} (partial_rotary_factor / rope.dimension_count)")
    if config.num_experts:
        _check_experts(config, where)
    elif not _positive_int(config.intermediate_size):
        raise ModelLoadError(f"{where}: intermediate_size must be a positive integer, not "
                             f"{config.intermediate_size!r}")
    if config.sliding_layers and not _positive_int(config.sliding_window):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer, not {config.sliding_window!r}")
    for field in ("sliding_layers", "nope_layers", "moe_layers"):
        layers = getattr(config, field) or ()
        if any(not isinstance(i, int) or not 0 <= i < config.num_layers for i in layers):
            raise ModelLoadError(f"{where}: {field} {list(layers)} names layers outside 0..{config.num_layers - 1}")
    return config


def _check_experts(config: ModelConfig, where: str) -> None:
    if not _positive_int(config.num_experts):
        raise ModelLoadError(f"{where}: {_name('num_experts')} must be a positive integer, not {config.num_experts!r}")
    k = config.num_experts_per_tok
    if not _positive_int(k) or k > config.num_experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok must be between 1 and the {config.num_experts} experts, "
                             f"not {k!r}")
    if not _positive_int(config.moe_intermediate_size):
        raise ModelLoadError(f"{where}: the experts' intermediate size (moe_intermediate_size) must be a positive "
                             f"integer, not {config.moe_intermediate_size!r}")
    dense = [i for i in range(config.num_layers) if not config.is_moe_layer(i)]
    if dense and not _positive_int(config.intermediate_size):
        raise ModelLoadError(f"{where}: intermediate_size must be a positive integer (layers {dense[:4]} are dense), "
                             f"not {config.intermediate_size!r}")
