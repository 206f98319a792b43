"""Llama 4 GGUF files as llama.cpp writes and reads them (arch `llama4`): metadata → ModelConfig fields
and the shared expert's tensor names.

llama.cpp's converter keeps the checkpoint's q/k rows as they are (Meta's interleaved RoPE pairs, which
llama.cpp's "norm" RoPE expects), splits the fused experts into stacked `ffn_{gate,up,down}_exps`, and
writes Llama 3-style RoPE scaling as a `rope_freqs` tensor. Its loader rebuilds the rest by convention:
- MoE layers every `interleave_moe_layer_step`-th ((i + 1) % step == 0), the others dense with
  `feed_forward_length`; experts and the shared expert `expert_feed_forward_length` wide; a sigmoid of
  the top-k router logits scales each chosen expert's input.
- unless `attention.sliding_window` is 0: every 4th layer has no RoPE ((i + 1) % 4 == 0), the others
  attend in 8,192-token chunks, and NoPE layers' temperature tuning starts at 8,192; neither is built
  here, so the served context stops at 8,191, where both equal plain attention (as for safetensors).
- q/k L2-normalised (RMS, no weight) on RoPE layers, except for the 128-expert model (Maverick).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferrylm.model.loaders.model_source import ModelLoadError

# llama.cpp's shared-expert tensors → the HF module names (Llama4TextMoe.shared_expert)
LAYER_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
NO_ROPE_STEP = 4  # llama.cpp's hparams.n_no_rope_layer_step
CHUNK = 8192  # llama.cpp's n_swa (chunked attention) and n_attn_temp_floor_scale for this arch
NO_QK_NORM_EXPERTS = 128  # llama.cpp: use_kq_norm = type != LLM_TYPE_17B_128E


def llama4_gguf_fields(key: Callable[..., Any], num_layers: int, path: str) -> dict:
    """ModelConfig fields of a `llama4` file, read as llama.cpp reads them."""
    experts = key("expert_count") or 0
    if experts < 1:
        raise ModelLoadError(f"{path}: a llama4 GGUF needs llama4.expert_count > 0 (llama.cpp refuses it too)")
    width, step = key("expert_feed_forward_length"), key("interleave_moe_layer_step")
    if not width or not step:
        raise ModelLoadError(f"{path}: llama4.expert_feed_forward_length and llama4.interleave_moe_layer_step "
                             "are required")
    chunked = key("attention.sliding_window") != 0
    return dict(num_experts=experts, num_experts_per_tok=key("expert_used_count") or 1,
                moe_intermediate_size=width, moe_router="sigmoid", shared_expert_intermediate_size=width,
                moe_layers=tuple(i for i in range(num_layers) if (i + 1) % step == 0),
                nope_layers=tuple(i for i in range(num_layers) if (i + 1) % NO_ROPE_STEP == 0) if chunked else (),
                qk_l2_norm=experts != NO_QK_NORM_EXPERTS,
                max_position_embeddings=min(key("context_length", 2048), CHUNK - 1) if chunked
                else key("context_length", 2048))
