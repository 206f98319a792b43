"""fp8 W8A8: the torch._scaled_mm call against its twin (dequantized weight times dequantized fp8
activations), on the CPU where this torch runs _scaled_mm, and a tiny model end to end on CUDA.

The method itself refuses the CPU (test_quant_errors.py); Fp8Weight is exercised directly here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrylm.model.quant.fp8 import FP8_MAX, Fp8Weight, quantize_fp8_rows


def _scaled_mm_runs(device: str) -> bool:
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _twin(weight: Fp8Weight, x: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_fp8_rows(x)
    return F.linear(xq.float() * xs, weight.dequantize(torch.float32))


def test_fp8_row_quantization_bounds():
    t = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    q, s = quantize_fp8_rows(t)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (32, 1)
    assert q.float().abs().amax(dim=1).max() <= FP8_MAX
    rel = ((q.float() * s - t).abs() / t.abs().amax(dim=1, keepdim=True)).max()
    assert rel < 2 ** -4  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA"))])
def test_fp8_matmul_matches_twin(device):
    if not _scaled_mm_runs(device):
        pytest.skip(f"torch._scaled_mm does not run on {device} in this torch")
    gen = torch.Generator().manual_seed(0)
    weight = Fp8Weight((torch.randn(96, 128, generator=gen) * 0.05).to(device))
    for rows in (1, 7, 64):
        x = torch.randn(rows, 128, generator=gen).to(device, torch.bfloat16)
        got, ref = weight.matmul(x), _twin(weight, x)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_fp8_tiny_model_end_to_end(tmp_path):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    from ferrylm import LLM, SamplingParams
    from tests.model.tiny_models import make_tiny_model

    directory = make_tiny_model("llama", tmp_path / "llama")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fp8 = LLM(str(directory), dtype="bfloat16", device="cuda", quantization="fp8", num_gpu_blocks_override=64)
    out = fp8.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8 and all(0 <= t < 320 for t in out)
