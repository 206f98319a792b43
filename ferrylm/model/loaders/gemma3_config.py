"""Gemma 3's config.json fields beyond the Llama family's, read as transformers' Gemma3TextConfig does.

Two config.json layouts exist: transformers 5 nests RoPE per layer type (`rope_parameters`:
{"sliding_attention": {...}, "full_attention": {...}}); older files have `rope_theta` (full layers),
`rope_local_base_freq` (sliding layers) and `rope_scaling` (full layers only). Layer kinds come from
`layer_types`, else from `sliding_window_pattern` (every n-th layer full, default 6).
"""

from __future__ import annotations

from typing import Any

from ferrylm.model.loaders.model_source import ModelLoadError

# Gemma3TextConfig's defaults: a Gemma3ForConditionalGeneration's text_config lists only what differs
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_rope(cfg: dict, where: str) -> tuple[float, dict | None, float]:
    """(full layers' theta, their rope_scaling or None, sliding layers' theta)."""
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", TEXT_DEFAULTS["rope_theta"])}
        local = {"rope_theta": cfg.get("rope_local_base_freq", TEXT_DEFAULTS["rope_local_base_freq"])}
    theta = full.pop("rope_theta", TEXT_DEFAULTS["rope_theta"])
    local_theta = local.pop("rope_theta", TEXT_DEFAULTS["rope_local_base_freq"])
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(f"{where}: RoPE scaling of the sliding-window layers "
                             f"({local.get('rope_type', local.get('type'))!r}) is not supported")
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    return theta, scaling, local_theta


def gemma3_fields(cfg: dict, where: str) -> dict[str, Any]:
    """ModelConfig fields only Gemma 3 sets; a load error for a feature it cannot honour."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{where}: attn_logit_softcapping {cfg['attn_logit_softcapping']} is not supported "
                             "(soft-capped attention scores; Gemma 3 releases leave it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: use_bidirectional_attention (an embedding model) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or TEXT_DEFAULTS["hidden_activation"]
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{where}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern") or 6
    kinds = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    if len(kinds) != layers or any(k not in LAYER_TYPES for k in kinds):
        raise ModelLoadError(f"{where}: layer_types must list {layers} of {', '.join(LAYER_TYPES)}, not {kinds}")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer or null, not {window!r}")
    _, _, local_theta = gemma3_rope(cfg, where)
    return dict(
        sliding_window=window,
        sliding_layers=tuple(i for i, k in enumerate(kinds) if k == "sliding_attention"),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", TEXT_DEFAULTS["query_pre_attn_scalar"]),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        hidden_act=act,
        qk_norm=True,
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )
