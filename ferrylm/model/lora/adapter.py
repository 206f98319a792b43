"""A LoRA adapter in peft's format (adapter_config.json + adapter_model.safetensors), read and
checked against the base model before anything is served with it: every refusal names what is wrong."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ferrylm.config import ModelConfig
from ferrylm.executor import LoRAError

# peft's module names → (the fused Linear that holds them, the slice of its output they are)
MODULE_SLICES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                 "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRAAdapter:
    """The adapter's matrices per (layer, peft module): A [r, in] and B [out, r] with the scaling
    (lora_alpha / r, or / sqrt(r) with use_rslora) already folded into B."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each module an adapter may target, as in the base checkpoint."""
    q, kv, h, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.hidden_size, \
        config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check the adapter at `path` (a directory) for the base model `config`."""
    directory = Path(path)
    settings = _read_config(name, directory)
    rank = _check_settings(name, settings, max_rank)
    tensors = _read_tensors(name, directory)
    scale = settings.get("lora_alpha", rank) / (math.sqrt(rank) if settings.get("use_rslora") else rank)
    return LoRAAdapter(name, rank, _pair(name, tensors, config, rank, scale, dtype))


def _read_config(name: str, directory: Path) -> dict:
    file = directory / "adapter_config.json"
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {str(directory)!r}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is unreadable ({e})") from None
    if not isinstance(settings, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    return settings


def _check_settings(name: str, settings: dict, max_rank: int) -> int:
    """The rank; refuses what this runner would apply differently from peft."""
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {settings.get('peft_type')!r} is not LORA")
    rank = settings.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number, not {alpha!r}")
    unsupported = {"use_dora": settings.get("use_dora"), "fan_in_fan_out": settings.get("fan_in_fan_out"),
                   "modules_to_save": settings.get("modules_to_save"), "rank_pattern": settings.get("rank_pattern"),
                   "alpha_pattern": settings.get("alpha_pattern")}
    set_ = sorted(k for k, v in unsupported.items() if v)
    if settings.get("bias", "none") != "none":
        set_.append(f"bias={settings['bias']!r}")
    if set_:
        raise LoRAError(f"LoRA adapter {name!r}: {', '.join(set_)} not supported")
    return rank


def _read_tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {str(directory)!r}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors is corrupt ({e})") from None


def _pair(name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int, scale: float,
          dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """A and B of each targeted module, shape-checked against the base model."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in MODULE_SLICES:
            raise LoRAError(f"LoRA adapter {name!r}: cannot apply {key!r} (targets: "
                            f"{', '.join(MODULE_SLICES)} of the decoder layers)")
        layer, module = int(match.group(1)), match.group(3)
        if layer >= config.num_layers or config.is_moe_layer(layer) and match.group(2) == "mlp":
            raise LoRAError(f"LoRA adapter {name!r}: cannot apply {key!r} to this model "
                            f"({config.num_layers} layers{', MoE MLPs' if config.num_experts else ''})")
        found.setdefault((layer, module), {})[match.group(4)] = tensor
    shapes, pairs = module_shapes(config), {}
    for (layer, module), ab in sorted(found.items()):
        out, inp = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.shape != (rank, inp) or b.shape != (out, rank):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} needs lora_A [{rank}, {inp}] and "
                            f"lora_B [{out}, {rank}], found {_shape(a)} and {_shape(b)}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has non-finite values")
        pairs[(layer, module)] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights found")
    return pairs


def _shape(t: torch.Tensor | None) -> str:
    return "nothing" if t is None else str(list(t.shape))
