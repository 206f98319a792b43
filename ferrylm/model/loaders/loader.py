"""Build a model from a ModelSource: config, empty parameters, then weights streamed into them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from ferrylm.config import ModelConfig, QuantConfig
from ferrylm.model.arch.gemma3 import Gemma3ForCausalLM
from ferrylm.model.arch.layers import Linear, RotaryEmbedding
from ferrylm.model.arch.llama import LlamaForCausalLM
from ferrylm.model.attention.base import AttentionBackend
from ferrylm.model.loaders.config_checks import check_model_config
from ferrylm.model.loaders.model_source import ModelLoadError, ModelSource
from ferrylm.model.quant import select_quant_method

if TYPE_CHECKING:
    from ferrylm.model.loaders.gguf_loader import GGUFTensor
    from ferrylm.model.loaders.int4_checkpoint import Int4Tensor

    # a checkpoint tensor: float, a GGUF tensor still in its blocks, or an AWQ / GPTQ module's int4 weight
    CheckpointTensor = torch.Tensor | GGUFTensor | Int4Tensor

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

# ModelConfig.architecture → its model class; every other architecture is LlamaForCausalLM
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"gemma3": Gemma3ForCausalLM}

# checkpoint projection → (packed parameter, shard index)
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Checkpoint:
    """An opened checkpoint: its ModelConfig now, its weights streamed on demand (opened once)."""

    def __init__(self, source: ModelSource):
        self.source = source
        try:
            if source.kind == "gguf":
                from ferrylm.model.loaders.gguf_loader import GGUFFile, load_gguf_config

                self._gguf = GGUFFile(source.path)
                self.config = load_gguf_config(self._gguf, source.name)
            else:
                from ferrylm.model.loaders.hf_loader import load_hf_config

                self.config = load_hf_config(source.path, source.name)
        except KeyError as e:  # a field the architecture needs is missing
            raise ModelLoadError(f"{source.path}: the model's config has no {e.args[0]!r}") from None
        except (TypeError, ZeroDivisionError, AttributeError) as e:  # a field of the wrong type or value
            raise ModelLoadError(f"{source.path}: malformed model config ({type(e).__name__}: {e})") from None
        check_model_config(self.config, str(source.path))

    def weights(self) -> Iterable[tuple[str, CheckpointTensor]]:
        """(name, float tensor) pairs, or for GGUF 2-D tensors still in their blocks (GGUFTensor)."""
        if self.source.kind == "gguf":
            from ferrylm.model.loaders.gguf_loader import iter_gguf_weights

            return iter_gguf_weights(self._gguf, self.config)
        from ferrylm.model.loaders.hf_loader import canonical_weights, iter_hf_weights, read_json
        from ferrylm.model.loaders.int4_checkpoint import assemble_int4, read_quantization_config

        weights: Iterator[tuple[str, Any]] = iter_hf_weights(self.source.path)  # as canonical_weights takes them
        if self.config.prequantized:
            fmt = read_quantization_config(read_json(self.source.path / "config.json"), str(self.source.path))
            weights = assemble_int4(weights, fmt) if fmt is not None else weights
        return canonical_weights(weights, self.config)


class CheckpointLike(Protocol):
    """What load_model reads: a Checkpoint, or one tensor-parallel rank's share of one (parallel.tp's
    ShardedCheckpoint, whose `source` is a SimpleNamespace with `kind` and `path`)."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def source(self) -> ModelSource | SimpleNamespace: ...

    def weights(self) -> Iterable[tuple[str, CheckpointTensor]]: ...


def _shard_slice(config: ModelConfig, packed: str, index: int, out_features: int) -> slice:
    """Rows of the packed parameter (`out_features` rows) that one checkpoint projection fills."""
    if packed == "gate_up_proj":  # dense MLP or one expert's: its own width
        n = out_features // 2
        return slice(index * n, (index + 1) * n)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][index]


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, CheckpointTensor]], origin: str) -> None:
    """Copy checkpoint tensors into the model; every weight must be filled. A Linear's weight goes
    through its QuantMethod (q/k/v and gate/up fill row ranges of the packed projections); tensors
    are float, or GGUF tensors still in their blocks (gguf_loader.GGUFTensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    tied = model.config.tie_word_embeddings
    filled: dict[str, int] = {}
    for ckpt_name, tensor in weights:
        name = ckpt_name.removeprefix("model.")
        if tied and name == "lm_head.weight":
            continue
        if tied and name == "embed_tokens.weight":
            name = "lm_head.weight"  # one weight: lm_head's QuantMethod owns it, the embedding reads it
        m = re.fullmatch(r"(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)", name)
        target, rows = name, slice(None)
        if m:
            packed, index = _PACKED[m.group(2)]
            target = f"{m.group(1)}.{packed}.{m.group(3)}"
            packed_layer = linears.get(f"{m.group(1)}.{packed}")
            rows = _shard_slice(model.config, packed, index, packed_layer.out_features if packed_layer else 0)
        module_name, _, attr = target.rpartition(".")
        layer = linears.get(module_name)
        if layer is not None and attr == "weight":
            expected_shape = (len(range(layer.out_features)[rows]), layer.in_features)
            _check_shape(origin, ckpt_name, tuple(tensor.shape), expected_shape)
            layer.quant.load_weight(layer, tensor, rows)
        elif target in params:
            dest = params[target].data[rows]
            _check_shape(origin, ckpt_name, tuple(tensor.shape), tuple(dest.shape))
            dest.copy_(tensor if isinstance(tensor, torch.Tensor) else tensor.to_float())
        else:
            continue  # e.g. rotary inv_freq buffers saved by old checkpoints
        filled[target] = filled.get(target, 0) + 1
    expected_names = {f"{name}.weight" for name in linears} | set(params)
    if tied:
        expected_names.discard("embed_tokens.weight")  # the same Parameter as lm_head.weight
    expected = {"qkv_proj": 3, "gate_up_proj": 2}
    for name in sorted(expected_names):
        need = next((n for key, n in expected.items() if f".{key}." in name), 1)
        if filled.get(name, 0) < need:
            raise ModelLoadError(f"{origin}: checkpoint is missing weights for {name!r}")


def _check_shape(origin: str, ckpt_name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ModelLoadError(f"{origin}: tensor {ckpt_name!r} has shape {got}, expected {expected}")


def _materialize(model: ModuleT, device: torch.device) -> ModuleT:
    """`to_empty(device)` without meta-tensor `empty_like`, whose first call imports torch's Python meta
    registrations and sympy (~1 s of every start)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(checkpoint: CheckpointLike, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
               max_positions: int | None = None, fused_ops=None,
               quantization: QuantConfig | None = None, tp=None, int8_activations: bool = False) -> LlamaForCausalLM:
    """Allocate on the meta device, materialise in `dtype` on `device`, fill from the checkpoint, then let
    each Linear's QuantMethod (chosen from `quantization`, see quant.select_quant_method) process it.
    `int8_activations`: packed weights' decode GEMVs quantize fp32 activations to int8 too."""
    config = checkpoint.config
    if config.sliding_window and config.sliding_layers and not getattr(backend, "supports_sliding_window", False):
        raise ModelLoadError(f"{checkpoint.source.path}: the model's sliding-window attention (window "
                             f"{config.sliding_window}) is not supported by the {type(backend).__name__} attention "
                             "backend (the CPU and torch backends support it)")
    kind = getattr(checkpoint.source, "kind", "hf")
    method = select_quant_method(quantization, kind, device, dtype, int8_activations, config.prequantized)
    with torch.device("meta"):
        model = MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)(
            config, backend, max_positions, fused_ops, quant=method, lm_head_quant=method.lm_head_method(), tp=tp)
    model = _materialize(model.to(dtype), device)  # dtype cast on meta is free
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_table(device)
    load_weights(model, checkpoint.weights(), str(checkpoint.source.path))
    model.process_weights_after_loading()
    return model.eval()
