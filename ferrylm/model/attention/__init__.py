"""Paged attention backends and the one place that chooses between them (`select_backend`)."""

from __future__ import annotations

from ferrylm.model.attention.base import AttentionBackend, AttentionSpec

BACKEND_KINDS = ("auto", "torch", "cpu", "triton")


def select_backend(spec: AttentionSpec, kind: str = "auto") -> AttentionBackend:
    """The backend for `spec.device`: "auto" takes Triton on CUDA when triton imports, the C++ CPU
    kernels on CPU when they build, and the torch-native oracle otherwise; "torch", "cpu" and
    "triton" ask for one (tests, parity checks) and raise if it cannot run here."""
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown attention backend {kind!r}; choose one of {', '.join(BACKEND_KINDS)}")
    from ferrylm.model.attention.cpu import CpuBackend, cpu_fused_ops
    from ferrylm.model.attention.torch_native import TorchNativeBackend

    if kind == "torch":
        return TorchNativeBackend()
    if kind == "triton" or (kind == "auto" and spec.device.type == "cuda"):
        from ferrylm.model.attention.triton import TritonBackend, triton_available  # ~0.3 s: only off the CPU

        if kind == "triton" or triton_available():
            return TritonBackend(spec)
    kernels = cpu_fused_ops(spec.device)  # None off the CPU, or when the extension does not build
    if kernels is not None:
        return CpuBackend(kernels)
    if kind == "cpu":
        raise RuntimeError(f"the C++ CPU attention kernels are unavailable on {spec.device}")
    return TorchNativeBackend()


__all__ = ["AttentionBackend", "AttentionSpec", "BACKEND_KINDS", "select_backend"]
