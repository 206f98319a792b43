"""Random-weight Llama / Qwen2 / Mistral checkpoints built with transformers, saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def make_tiny_model(kind: str, directory: Path, shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random model of `kind` (llama | qwen2 | mistral | llama3) into `directory`."""
    import transformers

    torch.manual_seed(0)
    kw = {**COMMON, **overrides}
    if kind == "llama":
        config = transformers.LlamaConfig(**kw, tie_word_embeddings=False)
    elif kind == "llama3":
        config = transformers.LlamaConfig(**kw, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**kw, tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "mistral":
        config = transformers.MistralConfig(**kw, sliding_window=None, head_dim=32)
    else:
        raise ValueError(kind)
    config.eos_token_id = 2
    config.bos_token_id = 1
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms non-trivial so a missing weight shows up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    return directory
