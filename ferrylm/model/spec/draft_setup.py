"""Building the proposer a --speculative-config asks for: nothing for ngram (the Speculator's own),
the target's first layers for layer_skip, a second model loaded beside the target for draft_model.
Configs that cannot work with the target (another vocabulary, more draft layers than the target
has) are start-up errors naming the key."""

from __future__ import annotations

import logging

import torch

from ferrylm.config import ConfigError, ModelConfig, SpeculativeConfig
from ferrylm.model.arch.llama import LlamaForCausalLM
from ferrylm.model.spec.draft_proposer import ModelProposer, draft_kv_bytes_per_block
from ferrylm.model.spec.spec_step import max_spec_batch

log = logging.getLogger("ferrylm.runner")


def kv_bytes_per_block(spec: SpeculativeConfig | None, target: ModelConfig, block_size: int,
                       dtype: torch.dtype) -> int:
    """Bytes the draft's K/V adds to each pool block (0 without a model proposer)."""
    if spec is None or spec.method == "ngram":
        return 0
    if spec.method == "layer_skip":
        return draft_kv_bytes_per_block(target, min(spec.num_layers or 0, target.num_layers), block_size, dtype)
    draft = _draft_checkpoint(spec).config
    return draft_kv_bytes_per_block(draft, draft.num_layers, block_size, dtype)


def build_proposer(spec: SpeculativeConfig, target: LlamaForCausalLM, target_config: ModelConfig, num_blocks: int,
                   block_size: int, max_model_len: int, dtype: torch.dtype, device: torch.device, attention: str,
                   eos_token_ids: list[int]) -> ModelProposer | None:
    """The ModelProposer for layer_skip / draft_model over `num_blocks` pool blocks; None for ngram."""
    if spec.method == "ngram":
        return None
    check_against_target(spec, target_config)
    k, max_batch = spec.num_speculative_tokens, max_spec_batch(spec, device)
    if spec.method == "layer_skip":
        return ModelProposer(target, spec.num_layers or 0, k, num_blocks, block_size, max_batch, max_model_len,
                             eos_token_ids, dtype, device)
    draft = _load_draft(spec, block_size, max_model_len, dtype, device, attention)
    return ModelProposer(draft, draft.config.num_layers, k, num_blocks, block_size, max_batch, max_model_len,
                         eos_token_ids, dtype, device)


def check_against_target(spec: SpeculativeConfig, target: ModelConfig) -> None:
    """What only the target can tell: layer_skip keeps fewer layers than it has, a draft model exists
    and shares its vocabulary. Reads configs only (the CLI calls it before any weights load)."""
    if spec.method == "layer_skip" and (spec.num_layers or 0) >= target.num_layers:
        raise ConfigError(f"--speculative-config num_layers {spec.num_layers} must be below the target's "
                          f"{target.num_layers} layers (layer_skip drafts with a prefix of them)")
    if spec.method == "draft_model":
        draft = _draft_checkpoint(spec).config
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"--speculative-config model {spec.model!r} has a vocabulary of {draft.vocab_size} "
                              f"tokens, the target {target.vocab_size}: a draft model must share the target's "
                              "tokenizer")


def check_startup(spec: SpeculativeConfig, model: str) -> None:
    """check_against_target for `model` (the target's alias or path); a target that does not resolve
    is left to the engine's own load error."""
    from ferrylm.model.loaders.loader import Checkpoint
    from ferrylm.model.loaders.model_source import ModelLoadError, resolve_model

    try:
        target = Checkpoint(resolve_model(model)).config
    except ModelLoadError:
        return
    check_against_target(spec, target)


def _draft_checkpoint(spec: SpeculativeConfig):
    """The draft model's checkpoint (config now, weights on demand); a missing model is a ConfigError."""
    from ferrylm.model.loaders.loader import Checkpoint
    from ferrylm.model.loaders.model_source import ModelLoadError, resolve_model

    try:
        return Checkpoint(resolve_model(spec.model or ""))
    except ModelLoadError as e:
        raise ConfigError(f"--speculative-config model: {e}") from None


def _load_draft(spec: SpeculativeConfig, block_size: int, max_model_len: int, dtype: torch.dtype,
                device: torch.device, attention: str) -> LlamaForCausalLM:
    from ferrylm.model.attention import AttentionSpec, select_backend
    from ferrylm.model.attention.cpu import cpu_fused_ops
    from ferrylm.model.loaders.loader import load_model

    checkpoint = _draft_checkpoint(spec)
    config = checkpoint.config
    backend = select_backend(AttentionSpec.for_model(config, block_size, dtype, device), attention)
    model = load_model(checkpoint, dtype, device, backend, max_model_len, cpu_fused_ops(device))
    log.info("draft model %s loaded: %d layers, hidden size %d", spec.model, config.num_layers, config.hidden_size)
    return model
