"""Build a model from a ModelSource: config, empty parameters, then weights streamed into them."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ferrylm.config import ModelConfig
from ferrylm.model.attention.base import AttentionBackend
from ferrylm.model.llama import LlamaForCausalLM
from ferrylm.model.model_source import ModelLoadError, ModelSource

# checkpoint projection → (packed parameter, shard index)
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Checkpoint:
    """An opened checkpoint: its ModelConfig now, its weights streamed on demand (opened once)."""

    def __init__(self, source: ModelSource):
        self.source = source
        if source.kind == "gguf":
            from ferrylm.model.gguf_loader import GGUFFile, load_gguf_config

            self._gguf = GGUFFile(source.path)
            self.config = load_gguf_config(self._gguf, source.name)
        else:
            from ferrylm.model.hf_loader import load_hf_config

            self.config = load_hf_config(source.path, source.name)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self.source.kind == "gguf":
            from ferrylm.model.gguf_loader import iter_gguf_weights

            return iter_gguf_weights(self._gguf, self.config)
        from ferrylm.model.hf_loader import iter_hf_weights

        return iter_hf_weights(self.source.path)


def _shard_slice(config: ModelConfig, packed: str, index: int) -> slice:
    """Rows of the packed parameter that one checkpoint projection fills."""
    if packed == "gate_up_proj":
        n = config.intermediate_size
        return slice(index * n, (index + 1) * n)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][index]


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], origin: str) -> None:
    """Copy checkpoint tensors into the model's (packed) parameters; every parameter must be filled."""
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}
    for ckpt_name, tensor in weights:
        name = ckpt_name.removeprefix("model.")
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = re.fullmatch(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)", name)
        target, rows = name, slice(None)
        if m:
            packed, index = _PACKED[m.group(2)]
            target, rows = f"{m.group(1)}.{packed}.{m.group(3)}", _shard_slice(model.config, packed, index)
        if target not in params:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        dest = params[target].data[rows]
        if dest.shape != tensor.shape:
            raise ModelLoadError(f"{origin}: tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled[target] = filled.get(target, 0) + 1
    expected = {"qkv_proj": 3, "gate_up_proj": 2}
    for name in params:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        need = next((n for key, n in expected.items() if f".{key}." in name), 1)
        if filled.get(name, 0) < need:
            raise ModelLoadError(f"{origin}: checkpoint is missing weights for {name!r}")


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
               max_positions: int | None = None, fused_ops=None) -> LlamaForCausalLM:
    """Allocate on the meta device, materialise in `dtype` on `device`, then fill from the checkpoint."""
    config = checkpoint.config
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, max_positions, fused_ops)
    model = model.to(dtype).to_empty(device=device)  # dtype cast on meta is free
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.build_table(device)
    load_weights(model, checkpoint.weights(), str(checkpoint.source.path))
    return model.eval()
