"""GGUF files: metadata → ModelConfig; tensors → HF-named, un-permuted, 2-D ones still in their blocks."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch

from ferrylm.config import ModelConfig
from ferrylm.model.loaders.gguf_dequant import BLOCK_SIZES, GGMLType, as_bytes, dequantize
from ferrylm.model.loaders.gguf_gemma3 import LAYER_NAMES as GEMMA3_LAYER_NAMES
from ferrylm.model.loaders.gguf_gemma3 import NORM_SHIFT as GEMMA3_NORM_SHIFT
from ferrylm.model.loaders.gguf_gemma3 import gemma3_gguf_fields
from ferrylm.model.loaders.gguf_llama4 import LAYER_NAMES as LLAMA4_LAYER_NAMES
from ferrylm.model.loaders.gguf_llama4 import llama4_gguf_fields
from ferrylm.model.loaders.hf_loader import FUSED_SUFFIXES, fused_rows
from ferrylm.model.loaders.model_source import ModelLoadError

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe", "gemma3": "gemma3", "phi3": "phi3", "llama4": "llama4"}
# Phi-3's fused projections as llama.cpp's converter writes them: attn_qkv = [q; k; v] rows, ffn_up =
# [gate; up] rows (its SwiGLU takes the first half as the gate, as transformers' Phi3MLP does)
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# experts stacked in one 3-D tensor [experts, rows, cols]: split into each expert's projection
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in the file (what GGUFReader found there)."""

    name: str
    tensor_type: int  # a GGMLType value
    shape: tuple[int, ...]  # GGUF order (innermost dimension first)
    data_offset: int  # from the start of the file
    n_bytes: int


# Arrays longer than this are not kept in the index (the vocabulary, merges): only their length.
_INDEXED_ARRAY_MAX = 4096


class GGUFFile:
    """An opened GGUF file with validated tensor extents: its metadata fields and tensor table.

    gguf's GGUFReader parses every field up front, the whole vocabulary included (4 s for SmolLM2,
    paid by every process that loads the model). What it finds (scalar fields, short arrays, the
    lengths of long ones, the tensor table) is kept in $FERRYLM_CACHE_DIR/gguf keyed by path, size
    and mtime, like the converted tokenizer; tensor bytes are read from a memmap of the file.
    """

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        index = _read_index(path) or _index_with_reader(path)
        self._fields: dict = index["fields"]
        self.tensors = [TensorInfo(t[0], t[1], tuple(t[2]), t[3], t[4]) for t in index["tensors"]]
        for t in self.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{path}: truncated, tensor {t.name!r} extends past the end of the file")
        self._map = np.memmap(path, dtype=np.uint8, mode="r")

    def field(self, key: str, default=None):
        """A field's value; for a long array (the vocabulary) only its length, see field_len."""
        value = self._fields.get(key, default)
        return default if isinstance(value, dict) and "length" in value else value

    def field_len(self, key: str) -> int | None:
        value = self._fields.get(key)
        if value is None:
            return None
        return value["length"] if isinstance(value, dict) and "length" in value else len(value)

    def data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes (a read-only uint8 view of the file)."""
        return self._map[t.data_offset:t.data_offset + t.n_bytes]

    @property
    def architecture(self) -> str:
        return self.field("general.architecture", "unknown")

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


def _index_path(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("FERRYLM_CACHE_DIR", Path.home() / ".cache" / "ferrylm"))
    return root / "gguf" / f"{key}.json"


def _read_index(path: Path) -> dict | None:
    try:
        index = json.loads(_index_path(path).read_text())
        return index if index.get("version") == 1 else None
    except (OSError, ValueError):
        return None  # absent or damaged: parse the file again


def _index_with_reader(path: Path) -> dict:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(f"{path}: reading GGUF needs the 'gguf' package (pip install gguf)") from None
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/IndexError/etc. on damaged headers
        raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt: {e})") from None
    fields = {}
    for name, f in reader.fields.items():
        if f.types and f.types[0].name == "ARRAY" and len(f.data) > _INDEXED_ARRAY_MAX:
            fields[name] = {"length": len(f.data)}
        else:
            fields[name] = f.contents()
    index = {"version": 1, "fields": fields,
             "tensors": [(t.name, int(t.tensor_type), [int(d) for d in t.shape.tolist()], int(t.data_offset),
                          int(t.n_bytes)) for t in reader.tensors]}
    _write_index(path, index)
    return index


def _write_index(path: Path, index: dict) -> None:
    """Atomically (a reader never sees half a file); a cache that cannot be written is skipped."""
    target = _index_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(index, f, default=_json_value)
        os.replace(tmp, target)
    except (OSError, TypeError, ValueError):
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)


def _json_value(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray)):
        return value.decode("utf-8", "replace")
    raise TypeError(f"not JSON: {type(value).__name__}")


def load_gguf_config(gguf: GGUFFile, name: str) -> ModelConfig:
    """Map GGUF metadata keys to a ModelConfig."""
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(f"{gguf.path}: unsupported architecture {arch!r} (supported: {supported})")

    def key(suffix: str, default=None):
        return gguf.field(f"{arch}.{suffix}", default)

    experts = {}
    if key("expert_count") and arch != "llama4":
        if arch not in ("llama", "qwen3moe"):
            raise ModelLoadError(f"{gguf.path}: mixture-of-experts GGUF files of arch {arch!r} "
                                 f"({arch}.expert_count {key('expert_count')}) are not supported "
                                 "(supported: llama (Mixtral), qwen3moe, llama4)")
        # llama.cpp renormalises the chosen experts' weights for both (Mixtral always; Qwen3-MoE's
        # releases set norm_topk_prob), unless the file says otherwise
        experts = dict(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                       moe_intermediate_size=key("expert_feed_forward_length") or key("feed_forward_length"),
                       norm_topk_prob=bool(key("expert_weights_norm", True)))
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length") or hidden // heads
    gemma3 = arch == "gemma3"
    extra = gemma3_gguf_fields(key, key("block_count"), hidden, heads, head_dim, str(gguf.path)) if gemma3 else \
        llama4_gguf_fields(key, key("block_count"), str(gguf.path)) if arch == "llama4" else {}
    span = extra.pop("max_position_embeddings", key("context_length", 2048))
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = (("factor", key("rope.scaling.factor")), ("rope_type", "linear"))
    names = gguf.tensor_names()
    for factors in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if factors in names:  # Phi-3's LongRoPE (Phi-3-128k, Phi-3.5)
            raise ModelLoadError(f"{gguf.path}: LongRoPE frequency factors ({factors.removesuffix('.weight')}) are "
                                 "not supported yet")
    # Phi-3: partial RoPE (rope.dimension_count of head_dim); attention.sliding_window is ignored, as
    # llama.cpp ignores it for this arch (it attends fully)
    rotary = key("rope.dimension_count") if arch == "phi3" else None
    freq_factors = _rope_freq_factors(gguf, (rotary or head_dim) // 2) if "rope_freqs.weight" in names else None
    if freq_factors is not None and scaling is not None:
        raise ModelLoadError(f"{gguf.path}: both rope_freqs and rope.scaling.type {key('rope.scaling.type')!r}: "
                             "only one RoPE scaling can apply")
    eos = gguf.field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="mixtral" if arch == "llama" and experts else GGUF_ARCHITECTURES[arch],
        vocab_size=_vocab_size(gguf, key("vocab_size")),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6 if gemma3 else 1e-5),
        rope_theta=key("rope.freq_base", 1_000_000.0 if gemma3 else 10000.0),  # transformers' defaults
        rope_scaling=scaling,
        max_position_embeddings=span,
        tie_word_embeddings="output.weight" not in names,
        rotary_dim=rotary if rotary and rotary != head_dim else None,
        rope_freq_factors=freq_factors,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        **experts,
        **extra,
        bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        name=name,
    )


def _rope_freq_factors(gguf: GGUFFile, frequencies: int) -> tuple[float, ...]:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1+ RoPE scaling (and Llama 4):
    one positive divisor per rotary frequency, applied to every RoPE layer."""
    t = next(t for t in gguf.tensors if t.name == "rope_freqs.weight")
    try:
        values = dequantize(gguf.data(t), t.tensor_type, tuple(reversed(t.shape))).flatten()
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: tensor 'rope_freqs.weight': {e}") from None
    if values.numel() != frequencies or not bool(torch.isfinite(values).all()) or not bool((values > 0).all()):
        raise ModelLoadError(f"{gguf.path}: tensor 'rope_freqs.weight' must hold {frequencies} finite positive "
                             f"factors (one per rotary frequency), not {values.numel()} values "
                             f"{values[:4].tolist()}...")
    return tuple(float(v) for v in values)


def _vocab_size(gguf: GGUFFile, declared: int | None) -> int:
    """The embedding's rows (llama.cpp's Gemma 3 converter drops the config's padding rows past the
    tokenizer's), else the declared vocab_size, else the vocabulary's length."""
    embedding = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and len(embedding.shape) == 2:
        return embedding.shape[1]  # GGUF order: [hidden, vocab]
    return declared or cast(int, gguf.field_len("tokenizer.ggml.tokens"))  # a GGUF model carries its vocabulary


def _hf_name(gguf_name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _expert_tensors(gguf: "GGUFFile", t: TensorInfo, layer: str, proj: str) -> Iterator[tuple[str, GGUFTensor]]:
    """A stacked expert tensor [E, rows, cols] as E GGUFTensors (each expert's rows are contiguous
    bytes), named like a safetensors checkpoint's experts."""
    experts, rows, cols = reversed(t.shape)
    try:
        data = _row_blocks(gguf, t, experts * rows, cols)
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: tensor {t.name!r}: {e}") from None
    for expert in range(experts):
        yield (f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
               GGUFTensor(t.tensor_type, data[expert * rows:(expert + 1) * rows], (rows, cols)))


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """A 2-D GGUF tensor still in its ggml blocks: `data` is uint8 [rows, bytes per row], `shape` the
    logical [rows, cols]. Rows are independent, so row permutations and row slices work on the bytes.
    A quantization method either repacks the blocks (quant/gguf.py) or asks for to_float()."""

    ggml_type: int
    data: torch.Tensor
    shape: tuple[int, int]

    def to_float(self) -> torch.Tensor:
        """Dequantized float32 [rows, cols]."""
        return dequantize(self.data, self.ggml_type, self.shape)

    def with_rows(self, data: torch.Tensor) -> "GGUFTensor":
        return GGUFTensor(self.ggml_type, data, self.shape)


def _row_blocks(gguf: GGUFFile, t: TensorInfo, rows: int, cols: int) -> torch.Tensor:
    """The tensor's blocks as uint8 [rows, bytes per row]; ValueError for a type or row length the
    blocks cannot be cut by."""
    kind, raw = t.tensor_type, gguf.data(t)
    if kind not in GGMLType._value2member_map_:
        dequantize(raw, kind, (rows, cols))  # raises the readable "unsupported type" error
    block, size = BLOCK_SIZES[GGMLType(kind)]
    if cols % block:
        raise ValueError(f"{GGMLType(kind).name}: row length {cols} is not a multiple of {block}")
    return as_bytes(raw).reshape(rows, cols // block * size)


def _raw_tensor(gguf: GGUFFile, t: TensorInfo) -> GGUFTensor | torch.Tensor:
    """A file tensor as a GGUFTensor (2-D) or a float32 tensor (1-D: norms)."""
    shape = tuple(reversed(t.shape))
    try:
        if len(shape) != 2:
            return dequantize(gguf.data(t), t.tensor_type, shape)
        return GGUFTensor(t.tensor_type, _row_blocks(gguf, t, *shape), shape)
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: tensor {t.name!r}: {e}") from None


def iter_gguf_weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, GGUFTensor | torch.Tensor]]:
    """Yield (HF checkpoint name, tensor) for every tensor the model uses: 2-D tensors as GGUFTensor
    (Q/K rows already un-permuted), 1-D ones as float32 (Gemma 3's norms without llama.cpp's +1)."""
    # q / k rows in llama.cpp's interleaved RoPE order: permuted by its converter (llama, Mistral,
    # Mixtral) or as Meta stores them (Llama 4)
    permute = config.architecture in ("llama", "mistral", "mixtral", "llama4")
    gemma3, phi3 = config.architecture == "gemma3", config.architecture == "phi3"
    extra_names = GEMMA3_LAYER_NAMES if gemma3 else _PHI3_FUSED if phi3 else \
        LLAMA4_LAYER_NAMES if config.architecture == "llama4" else {}
    layer_names = {**_LAYER_NAMES, **extra_names}
    for t in gguf.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight", t.name)
        if m:
            yield from _expert_tensors(gguf, t, m.group(1), _EXPERT_NAMES[m.group(2)])
            continue
        name = _hf_name(t.name, layer_names)
        if name is None:
            continue
        w = _raw_tensor(gguf, t)
        if gemma3 and name.endswith("norm.weight"):  # 1-D: a float32 tensor
            w = cast(torch.Tensor, w) - GEMMA3_NORM_SHIFT
        # q / k projections are 2-D: GGUFTensors
        if permute and name.endswith("q_proj.weight"):
            w = cast(GGUFTensor, w).with_rows(unpermute_qk(w.data, config.num_heads))
        elif permute and name.endswith("k_proj.weight"):
            w = cast(GGUFTensor, w).with_rows(unpermute_qk(w.data, config.num_kv_heads))
        if phi3 and name.endswith(FUSED_SUFFIXES):  # Phi-3's fused rows: row slices of the blocks
            fused = cast(GGUFTensor, w)
            for part, start, end in fused_rows(name, fused.shape[0], config, f"{gguf.path}: tensor {t.name!r}"):
                yield part, GGUFTensor(fused.ggml_type, fused.data[start:end], (end - start, fused.shape[1]))
            continue
        yield name, w
