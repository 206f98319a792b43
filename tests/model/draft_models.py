"""Draft models for speculative-decoding tests and benchmarks, written to a directory as Hugging Face
checkpoints (config.json + safetensors): SmolLM2 cut to its first layers (real weights, the same
vocabulary, so it guesses the target's next tokens often) and random-weight models of a given shape.
Nothing is downloaded: the weights come from the installed GGUF or a seeded generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ferrylm.config import ModelConfig


def hf_config(config: ModelConfig, num_layers: int) -> dict:
    """config.json of a Llama checkpoint with `config`'s shapes and `num_layers` layers."""
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings,
            "eos_token_id": list(config.eos_token_ids) or None, "bos_token_id": config.bos_token_id}


def write_checkpoint(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def write_truncated(model: str, num_layers: int, directory: Path) -> Path:
    """`model` (an alias or a GGUF / HF path) cut to its first `num_layers` layers, its embedding,
    final norm and LM head kept, dequantized to float32."""
    from ferrylm.model.loaders.loader import Checkpoint
    from ferrylm.model.loaders.model_source import resolve_model

    checkpoint = Checkpoint(resolve_model(model))
    kept = {}
    for name, tensor in checkpoint.weights():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= num_layers:
            continue
        kept[name] = (tensor if isinstance(tensor, torch.Tensor) else tensor.to_float()).float()
    return write_checkpoint(directory, hf_config(checkpoint.config, num_layers), kept)


def write_random(config: ModelConfig, directory: Path, seed: int = 0, std: float = 0.02) -> Path:
    """A random-weight checkpoint of `config`'s shape (tests.gpu.random_model's seeded draws)."""
    from tests.gpu.random_model import RandomCheckpoint

    weights = dict(RandomCheckpoint(config, seed=seed, std=std).weights())
    return write_checkpoint(directory, hf_config(config, config.num_layers), weights)
