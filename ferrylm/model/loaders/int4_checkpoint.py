"""Pre-quantized int4 safetensors (AWQ "gemm", GPTQ incl. act-order, compressed-tensors W4A16
"pack-quantized"): `quantization_config` read and checked, each Linear's packed codes, zeros and
scales (and g_idx) unpacked into integer codes, per-group scales and zero points, losslessly.

Both formats mean w = (q - z) * s per group of `group_size` inputs; the packed CPU kernel computes
w = scale * q + min, so scale = s and min = -s * z (an exact float32 product of the fp16 scale and
a 4-bit zero). The codes are the file's. Layouts (documented by AutoAWQ and AutoGPTQ/GPTQModel;
vLLM's awq_dequantize / gptq kernels read them the same way):
  AWQ:  qweight [K, N/8] int32, nibble p of word j is column 8j + ORDER[p] (ORDER = 0 2 4 6 1 3 5 7);
        qzeros [K/g, N/8] the same; scales [K/g, N] fp16.
  GPTQ: qweight [K/8, N] int32, nibble p of word row j is input 8j + p; qzeros [K/g, N/8], nibble p is
        column 8j + p, stored as z - 1 ("gptq" format; "gptq_v2" stores z); scales [K/g, N];
        g_idx [K]: the group of each input (act-order / desc_act shuffles it).
  compressed-tensors (llm-compressor's W4A16, vLLM's CompressedTensorsWNA16): weight_packed [N, K/8]
        int32, nibble p of word j is input 8j + p, holding the signed code + 8; weight_scale [N, K/g];
        symmetric: zero 8; asymmetric: weight_zero_point [N/8, K/g] int32 packed along outputs (nibble p
        of word row j is output 8j + p, the signed zero + 8); weight_g_idx [K] with actorder "group".
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ferrylm.model.loaders.model_source import ModelLoadError

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p holds column ORDER[p] of its 8
_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx"),
          "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")}
_REQUIRED = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales"),
             "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape")}


@dataclass(frozen=True)
class Int4Format:
    """What a checkpoint's quantization_config says, once checked."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # -1: one group over all inputs
    zero_offset: int  # added to a stored zero (GPTQ v1: 1)
    symmetric: bool = False  # compressed-tensors: no zero points stored (the zero is 8)


def read_quantization_config(cfg: dict, origin: str) -> Int4Format | None:
    """The int4 format of config.json's quantization_config; None without one. Anything FerryLM
    cannot serve exactly is a ModelLoadError naming the field."""
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc, origin)
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"{origin}: quantization_config.quant_method {qc.get('quant_method')!r} is not "
                             "supported (supported: awq, gptq, compressed-tensors)")
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


def _compressed_tensors_format(qc: dict, origin: str) -> Int4Format:
    """compressed-tensors' W4A16 (one scheme over every Linear, weights int4 packed, activations left
    float); any other scheme is a ModelLoadError naming the field."""
    where = f"{origin}: quantization_config"
    if qc.get("format") != "pack-quantized":
        raise ModelLoadError(f"{where}.format {qc.get('format')!r} is not supported (pack-quantized: W4A16)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ModelLoadError(f"{where}.config_groups: one scheme is supported, found "
                             f"{len(groups) if isinstance(groups, dict) else groups!r}")
    (name, scheme), = groups.items()
    where = f"{where}.config_groups.{name}"
    if not isinstance(scheme, dict) or scheme.get("targets") != ["Linear"]:
        raise ModelLoadError(f"{where}.targets must be [\"Linear\"]")
    for field in ("input_activations", "output_activations"):
        if scheme.get(field) is not None:
            raise ModelLoadError(f"{where}.{field} is not supported (weight-only W4A16)")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{where}.weights is missing")
    for field, want in (("num_bits", 4), ("type", "int"), ("dynamic", False)):
        if weights.get(field, want) != want:
            raise ModelLoadError(f"{where}.weights.{field} {weights.get(field)!r} is not supported ({want!r})")
    strategy = weights.get("strategy")
    group: int = -1  # "channel": one group over all inputs
    if strategy == "group":
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0 or size % 32:
            raise ModelLoadError(f"{where}.weights.group_size {size!r} is not supported (a multiple of 32)")
        group = size
    elif strategy != "channel":
        raise ModelLoadError(f"{where}.weights.strategy {strategy!r} is not supported (group, channel)")
    if weights.get("actorder") not in (None, "group"):
        raise ModelLoadError(f"{where}.weights.actorder {weights.get('actorder')!r} is not supported (null, group)")
    return Int4Format("compressed-tensors", group, 0, symmetric=weights.get("symmetric", True) is not False)


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
    if fmt.method == "compressed-tensors":
        return _unpack_compressed_tensors(fmt, parts, name)
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
    return _grouped(q, z, scales, group, parts.get("g_idx"), name)


def _unpack_compressed_tensors(fmt: Int4Format, parts: dict[str, torch.Tensor], name: str) -> Int4Tensor:
    shape = parts["weight_shape"].tolist()
    packed, scales = parts["weight_packed"], parts["weight_scale"].float()
    if len(shape) != 2 or shape[1] % 8 or tuple(packed.shape) != (shape[0], shape[1] // 8):
        raise ModelLoadError(f"{name}: weight_packed {tuple(packed.shape)} does not hold weight_shape {shape}")
    n, k = shape
    q = _nibbles(packed).reshape(n, k).t()  # [K, N]
    group = k if fmt.group_size == -1 else fmt.group_size
    if k % group or tuple(scales.shape) != (n, k // group):
        raise ModelLoadError(f"{name}: weight_scale {tuple(scales.shape)} does not fit group_size {group} of "
                             f"weight_shape {shape}")
    if fmt.symmetric:
        z = torch.full((k // group, n), 8, dtype=torch.int32)
    else:
        zp = parts.get("weight_zero_point")
        if zp is None or tuple(zp.shape) != (-(-n // 8), k // group):
            raise ModelLoadError(f"{name}: an asymmetric scheme needs weight_zero_point [{-(-n // 8)}, {k // group}], "
                                 f"found {None if zp is None else tuple(zp.shape)}")
        z = _nibbles(zp).permute(1, 0, 2).reshape(k // group, -1)[:, :n]  # [G, N]: nibble p of row j: output 8j + p
    return _grouped(q, z, scales.t(), group, parts.get("weight_g_idx"), name)


def _grouped(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group: int, g_idx: torch.Tensor | None,
             name: str) -> Int4Tensor:
    """q [K, N] codes, z and scales [K/group, N], `g_idx` [K] (None: inputs in order) → Int4Tensor."""
    k = q.shape[0]
    perm = None
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
        if part in _PARTS[fmt.method]:
            pending.setdefault(module, {})[part] = tensor
        else:
            yield name, tensor
    for module, parts in pending.items():
        missing = [p for p in _REQUIRED[fmt.method] if p not in parts]
        if missing:
            raise ModelLoadError(f"{module}: {fmt.method} checkpoint lacks {', '.join(missing)}")
        yield f"{module}.weight", unpack(fmt, parts, module)
