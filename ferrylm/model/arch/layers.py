"""Transformer building blocks: RMSNorm (Llama's and Gemma's), rotary embedding, gated activations, linear."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.model.quant.base import QuantMethod, StoredWeight, UnquantizedMethod

if TYPE_CHECKING:
    from ferrylm.model.loaders.gguf_loader import GGUFTensor
    from ferrylm.model.loaders.int4_checkpoint import Int4Tensor
    from ferrylm.model.lora.slots import LoRASlots


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the reference, then cast back to the activation dtype.

    `fused_ops` (the CPU extension, optional) does residual-add + norm in one in-place call.
    """

    def __init__(self, hidden_size: int, eps: float, fused_ops=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused_ops = fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual += x; return norm(residual), residual`; in place on x and residual when fused."""
        if self.fused_ops is not None and x.is_contiguous() and residual.is_contiguous():
            self.fused_ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * (1 + w), all in float32, then cast (Llama casts before the weight; in
    bf16 the two differ, so Gemma keeps its own). Checkpoints store w around 0, not around 1."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual + x`, then its norm and the sum (RMSNorm's contract, unfused)."""
        residual = residual + x
        return self.forward(residual), residual


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency-dependent RoPE scaling (smooth blend of scaled and unscaled bands)."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


ROPE_TYPES = ("default", "linear", "llama3")  # the rope_scaling types RotaryEmbedding computes


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, fused_ops=None,
                 rotary_dim: int | None = None, freq_factors: tuple[float, ...] | None = None):
        """`rotary_dim`: the leading dims of each head that rotate (Phi's partial_rotary_factor); the
        rest pass through unrotated. Default: the whole head. `freq_factors`: one divisor per rotary
        frequency (a GGUF file's rope_freqs, as llama.cpp applies them), instead of `scaling`."""
        super().__init__()
        self.fused_ops = fused_ops
        self.rotary_dim = rotary_dim or head_dim
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in (*ROPE_TYPES, None):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        self.head_dim, self.max_positions, self.theta = head_dim, max_positions, theta
        self.scaling, self.rope_type = scaling, rope_type
        if freq_factors is not None and (len(freq_factors) != self.rotary_dim // 2 or scaling):
            raise ValueError(f"RoPE frequency factors: {len(freq_factors)} given for {self.rotary_dim // 2} "
                             "frequencies" + (", beside rope_scaling" if scaling else ""))
        self.freq_factors = freq_factors
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_table(torch.device("cpu"))

    def build_table(self, device: torch.device) -> None:
        """(Re)compute the table on `device`; also used after the model is materialised from meta."""
        # float32 throughout, exactly as the reference computes it, so logits match bit for bit.
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        if self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, cast(dict, self.scaling))  # a rope_type implies scaling
        elif self.rope_type == "linear":
            inv_freq = inv_freq / cast(dict, self.scaling)["factor"]
        if self.freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.float())
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def rotate_packed_(self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, head_dim: int) -> bool:
        """Rotate the q and k heads of a packed [T, (H + 2Hkv) D] projection in place, if fused ops exist."""
        if self.fused_ops is None or not qkv.is_contiguous() or self.rotary_dim != head_dim:
            return False
        self.fused_ops.rope_qkv_(qkv, positions, self.cos, self.sin, num_heads, head_dim)
        return True

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; rotation computed in float32."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim/2]
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        r = self.rotary_dim
        return (torch.cat((_rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((_rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class GatedMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up packed in one Linear; act is SiLU (SwiGLU)
    or, for Gemma, tanh-approximated GELU. A dense layer's MLP (arch/llama.py adds its TP all-reduce)
    and each expert of an MoE block (arch/moe.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, quant: QuantMethod | None = None,
                 hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden activation {hidden_act!r} (supported: "
                             f"{', '.join(GATED_ACTIVATIONS)})")
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, quant=quant)
        self.down_proj = Linear(intermediate_size, hidden_size, quant=quant)
        self.act = SiluAndMul() if hidden_act == "silu" else GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SiluAndMul(nn.Module):
    """SwiGLU: silu(gate) * up over a packed [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GeGLU with tanh-approximated GELU (transformers' gelu_pytorch_tanh) over [gate | up]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # config.hidden_act values GatedMLP computes


class Linear(nn.Module):
    """y = x W^T (+ b), W [out, in] as in checkpoints. How W is stored and multiplied is the layer's
    QuantMethod (quant/base.py): a float weight and F.linear unless a quantization is chosen."""

    # What the QuantMethod keeps on the layer: the float `weight` (create_weights), which a
    # StoredWeightMethod replaces by `packed` after loading; the GGUF and AWQ / GPTQ methods collect
    # the checkpoint's (first row, tensor) shards in `gguf_shards` / `int4_shards` until then.
    weight: torch.Tensor
    packed: StoredWeight
    gguf_shards: list[tuple[int, GGUFTensor | torch.Tensor]]
    int4_shards: list[tuple[int, Int4Tensor | torch.Tensor]]
    lora: LoRASlots | None  # --enable-lora: resident adapters' matrices (model/lora/), added per row group

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quant: QuantMethod | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.lora = None
        self.quant = quant if quant is not None else UnquantizedMethod()
        self.quant.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x)
        if self.lora is not None and self.lora.step.groups.rows is not None:
            return self.lora.add_delta(x, y)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, quant={self.quant.name}"
