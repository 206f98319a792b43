"""GGUF files: metadata → ModelConfig; tensors → HF-named, un-permuted, 2-D ones still in their blocks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ferrylm.config import ModelConfig
from ferrylm.model.gguf_dequant import BLOCK_SIZES, GGMLType, as_bytes, dequantize
from ferrylm.model.model_source import ModelLoadError

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFFile:
    """An opened GGUF file with validated tensor extents."""

    def __init__(self, path: Path):
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModelLoadError(f"{path}: reading GGUF needs the 'gguf' package (pip install gguf)") from None
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/IndexError/etc. on damaged headers
            raise ModelLoadError(f"{path}: not a valid GGUF file (truncated or corrupt: {e})") from None
        size = path.stat().st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{path}: truncated, tensor {t.name!r} extends past the end of the file")

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @property
    def architecture(self) -> str:
        return self.field("general.architecture", "unknown")

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def load_gguf_config(gguf: GGUFFile, name: str) -> ModelConfig:
    """Map GGUF metadata keys to a ModelConfig."""
    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(f"{gguf.path}: unsupported architecture {arch!r} (supported: {supported})")

    def key(suffix: str, default=None):
        return gguf.field(f"{arch}.{suffix}", default)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    tokens = gguf.field("tokenizer.ggml.tokens")
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = (("factor", key("rope.scaling.factor")), ("rope_type", "linear"))
    if "rope_freqs.weight" in gguf.tensor_names():
        raise ModelLoadError(f"{gguf.path}: per-frequency RoPE factors (rope_freqs) are not supported yet")
    eos = gguf.field("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=key("vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length") or hidden // heads,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in gguf.tensor_names(),
        attention_bias=arch == "qwen2",
        bos_token_id=gguf.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(eos,) if eos is not None else (),
        name=name,
    )


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


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


def _raw_tensor(t, path: Path) -> GGUFTensor | torch.Tensor:
    """A reader tensor as a GGUFTensor (2-D) or a float32 tensor (1-D: norms)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    kind = int(t.tensor_type)
    try:
        if len(shape) != 2:
            return dequantize(np.asarray(t.data), kind, shape)
        if kind not in GGMLType._value2member_map_:
            dequantize(np.asarray(t.data), kind, shape)  # raises the readable "unsupported type" error
        block, size = BLOCK_SIZES[GGMLType(kind)]
        if shape[1] % block:
            raise ValueError(f"{GGMLType(kind).name}: row length {shape[1]} is not a multiple of {block}")
        data = as_bytes(np.asarray(t.data)).reshape(shape[0], shape[1] // block * size)
        return GGUFTensor(kind, data, shape)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name!r}: {e}") from None


def iter_gguf_weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, GGUFTensor | torch.Tensor]]:
    """Yield (HF checkpoint name, tensor) for every tensor the model uses: 2-D tensors as GGUFTensor
    (Q/K rows already un-permuted), 1-D ones as float32."""
    permute = config.architecture in ("llama", "mistral")
    for t in gguf.reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        w = _raw_tensor(t, gguf.path)
        if permute and name.endswith("q_proj.weight"):
            w = w.with_rows(unpermute_qk(w.data, config.num_heads))
        elif permute and name.endswith("k_proj.weight"):
            w = w.with_rows(unpermute_qk(w.data, config.num_kv_heads))
        yield name, w
