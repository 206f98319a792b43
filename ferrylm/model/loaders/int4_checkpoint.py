"""Pre-quantized int4 safetensors (AWQ "gemm", GPTQ incl. act-order): `quantization_config` read and
checked, each Linear's qweight / qzeros / scales (/ g_idx) unpacked into integer codes, per-group
scales and zero points, losslessly.

Both formats mean w = (q - z) * s per group of `group_size` inputs; the packed CPU kernel computes
w = scale * q + min, so scale = s and min = -s * z (an exact float32 product of the fp16 scale and
a 4-bit zero). The codes are the file's. Layouts (documented by AutoAWQ and AutoGPTQ/GPTQModel;
vLLM's awq_dequantize / gptq kernels read them the same way):
  AWQ:  qweight [K, N/8] int32, nibble p of word j is column 8j + ORDER[p] (ORDER = 0 2 4 6 1 3 5 7);
        qzeros [K/g, N/8] the same; scales [K/g, N] fp16.
  GPTQ: qweight [K/8, N] int32, nibble p of word row j is input 8j + p; qzeros [K/g, N/8], nibble p is
        column 8j + p, stored as z - 1 ("gptq" format; "gptq_v2" stores z); scales [K/g, N];
        g_idx [K]: the group of each input (act-order / desc_act shuffles it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ferrylm.model.loaders.model_source import ModelLoadError

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p holds column ORDER[p] of its 8
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says, once checked."""

    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group over all inputs
    zero_offset: int  # added to a stored zero (GPTQ v1: 1)


def read_quantization_config(cfg: dict, origin: str) -> Int4Format | None:
    """The int4 format of config.json's quantization_config; None without one. Anything FerryLM
    cannot serve exactly is a ModelLoadError naming the field."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"{origin}: quantization_config.quant_method {qc.get('quant_method')!r} is not "
                             "supported (supported: awq, gptq)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{origin}: quantization_config.bits {bits!r} is not supported (4-bit only)")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
        raise ModelLoadError(f"{origin}: quantization_config.group_size {group!r} is not supported "
                             "(-1 or a multiple of 32)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(f"{origin}: quantization_config.version {qc.get('version')!r} is not supported "
                                 "(AWQ's gemm layout only)")
        if qc.get("zero_point") is False:
            raise ModelLoadError(f"{origin}: quantization_config.zero_point false is not supported")
        return Int4Format("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{origin}: quantization_config.checkpoint_format {qc.get('checkpoint_format')!r} "
                             "is not supported (gptq, gptq_v2)")
    return Int4Format("gptq", group, 1 if fmt == "gptq" else 0)


@dataclass
class Int4Tensor:
    """One Linear's weight [N, K] as the file stores it, unpacked: w[n, k] = scales[n, G(k)] *
    codes[n, k] + mins[n, G(k)], where G(k) = perm-order position // group, i.e. after permuting
    inputs by `perm` (act-order) the groups are contiguous; `perm` None: identity."""

    codes: torch.Tensor  # [N, K] uint8 0..15, inputs in perm order
    scales: torch.Tensor  # [N, K/group] float32
    mins: torch.Tensor  # [N, K/group] float32: -s * z
    group: int
    perm: torch.Tensor | None  # [K] int64: input perm[i] is column i of codes

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def to_float(self) -> torch.Tensor:
        """The dequantized weight [N, K] in the file's input order (the twin; tests and TP)."""
        g = self.group
        w = self.codes.float() * self.scales.repeat_interleave(g, 1) + self.mins.repeat_interleave(g, 1)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 → [..., W, 8] nibble p = bits 4p..4p+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (words.to(torch.int32)[..., None] >> shifts) & 0xF


def unpack(fmt: Int4Format, parts: dict[str, torch.Tensor], name: str) -> Int4Tensor:
    """One module's tensors → Int4Tensor (codes as the file's, scales fp32, mins -s*z)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    if fmt.method == "awq":
        k = qweight.shape[0]
        order = torch.tensor(_AWQ_ORDER).argsort()  # column c is nibble order[c]
        q = _nibbles(qweight)[..., order].reshape(k, -1)  # [K, N]
        z = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1)  # [G, N]
    else:
        k = qweight.shape[0] * 8
        q = _nibbles(qweight).permute(0, 2, 1).reshape(k, -1)  # [K, N]
        z = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + fmt.zero_offset  # [G, N]
    n = q.shape[1]
    group = k if fmt.group_size == -1 else fmt.group_size
    if scales.shape != (k // group, n) or z.shape != scales.shape or k % group:
        raise ModelLoadError(f"{name}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                             f"{tuple(parts['scales'].shape)} do not fit {fmt.method} with group_size {group}")
    perm = None
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.long()
        if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group or \
                torch.bincount(g_idx, minlength=k // group).ne(group).any():
            raise ModelLoadError(f"{name}: g_idx does not give each of the {k // group} groups {group} inputs")
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(order, torch.arange(k)):
            perm, q = order, q[order]
    return Int4Tensor(q.t().to(torch.uint8).contiguous(), scales.t().contiguous(),
                      (-scales * z.float()).t().contiguous(), group, perm)


def assemble_int4(weights: Iterator[tuple[str, torch.Tensor]], fmt: Int4Format) -> Iterator[tuple[str, object]]:
    """Float tensors pass through; each quantized module's parts (in any order, across shards) come
    out as one `<module>.weight` Int4Tensor once the iteration is over."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, part = name.rpartition(".")
        if part in _PARTS:
            pending.setdefault(module, {})[part] = tensor
        else:
            yield name, tensor
    for module, parts in pending.items():
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise ModelLoadError(f"{module}: {fmt.method} checkpoint lacks {', '.join(missing)}")
        yield f"{module}.weight", unpack(fmt, parts, module)
