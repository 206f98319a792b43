"""Gemma 3 GGUF files as llama.cpp writes and reads them (arch `gemma3`): metadata → ModelConfig
fields, tensor names, and the norm weights' +1.

llama.cpp's converter stores what config.json's `layer_types`, `rope_local_base_freq` and
`query_pre_attn_scalar` say only by convention, and its loader rebuilds them the same way; this
module reads a file as llama.cpp does:
- `attention.sliding_window` present and > 0: every 6th layer is full, the others slide
  (`attention.sliding_window_pattern`, a period or one bool per layer with true = sliding, overrides
  the 6); absent or 0: no layer slides (the converter leaves it out when every layer is full).
- sliding layers' RoPE base `rope.freq_base_swa`, else 10000, unscaled; `rope.scaling.*` applies to
  the full layers only.
- attention scale head_dim ** -0.5, but (hidden / heads) ** -0.5 for the 62-layer model (27B,
  whose query_pre_attn_scalar is 168 with a head_dim of 128).
- every `*norm.weight` holds Gemma's w + 1 (the converter adds it so x * w is the norm): loading
  subtracts it again, since GemmaRMSNorm computes x * (1 + w).
transformers reads the same files with Gemma3TextConfig's defaults for what the file leaves out:
the same layer kinds, local base and (except for the 27B) attention scale; it ignores
`rope.scaling.*` and `final_logit_softcapping` for this arch, where llama.cpp (and this module)
apply them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferrylm.model.loaders.model_source import ModelLoadError

# llama.cpp's layer tensor → the HF module name, where Gemma 3 differs from the Llama family's
# (its ffn_norm is the norm before the MLP; post_attention_norm and post_ffw_norm are the sandwich's)
LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
NORM_SHIFT = 1.0  # llama.cpp's converter adds it to every Gemma 3 *norm.weight
DEFAULT_PATTERN = 6  # llama.cpp's hparams.set_swa_pattern(6)
DEFAULT_LOCAL_THETA = 10_000.0
_LAYERS_27B = 62


def sliding_layers(pattern: Any, num_layers: int, where: str) -> tuple[int, ...]:
    """The sliding layers of a `sliding_window_pattern`: None (llama.cpp's 6), a period n (every
    n-th layer full) or one bool per layer (true: sliding)."""
    if pattern is None:
        pattern = DEFAULT_PATTERN
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{where}: gemma3.attention.sliding_window_pattern lists {len(pattern)} layers, "
                                 f"the model has {num_layers}")
        return tuple(i for i, sliding in enumerate(pattern) if sliding)
    if not isinstance(pattern, int) or pattern < 1:
        raise ModelLoadError(f"{where}: gemma3.attention.sliding_window_pattern must be a positive period "
                             f"or a list of bools, not {pattern!r}")
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def gemma3_gguf_fields(key: Callable[[str], Any], num_layers: int, hidden: int, heads: int, head_dim: int,
                       where: str) -> dict[str, Any]:
    """ModelConfig fields only Gemma 3 sets, from the file's `gemma3.*` keys (`key(suffix)` reads
    one, None when absent); a load error for what the model cannot honour."""
    if key("attn_logit_softcapping"):
        raise ModelLoadError(f"{where}: gemma3.attn_logit_softcapping {key('attn_logit_softcapping')} is not "
                             "supported (soft-capped attention scores; Gemma 3 releases have none)")
    window = key("attention.sliding_window") or None
    layers = sliding_layers(key("attention.sliding_window_pattern"), num_layers, where) if window else ()
    scalar = hidden // heads if num_layers == _LAYERS_27B else head_dim
    return dict(
        sliding_window=window,
        sliding_layers=layers,
        local_rope_theta=float(key("rope.freq_base_swa") or DEFAULT_LOCAL_THETA),
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=key("final_logit_softcapping") or None,
        hidden_act="gelu_pytorch_tanh",
    )
