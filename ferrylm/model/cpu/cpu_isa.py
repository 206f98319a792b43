"""Which instruction-set variant of the C++ kernels this CPU runs, decided from what the CPU reports.

Every kernel source is built once per variant with that variant's compiler flags (never
`-march=native`), into a library of its own whose torch ops live under `torch.ops.ferrylm_<variant>`;
at run time the best variant the CPU supports is loaded (llama.cpp's GGML_CPU_ALL_VARIANTS idea).
A build made on an AVX-512 machine and copied to an AVX2 one is therefore never chosen there: its
variant needs flags this CPU lacks (kernel_build.py also checks the manifest written beside it).

FERRYLM_CPU_ISA=<variant> forces a lower variant (tests, benchmarks: the AVX2 row on an AVX-512
machine); asking for one the CPU cannot run is an error, never an illegal instruction.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ferrylm.config import ConfigError


@dataclass(frozen=True)
class IsaVariant:
    """One build of the kernels: the CPU flags it needs (as /proc/cpuinfo names them) and the
    compiler flags that let the compiler use exactly those."""

    name: str
    arch: str  # platform.machine() it runs on; "any" for the portable twin
    requires: frozenset[str]
    cflags: tuple[str, ...]
    description: str


_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = _AVX2_FLAGS + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

# Lowest first; the best is the last one the CPU supports.
VARIANTS: tuple[IsaVariant, ...] = (
    IsaVariant("portable", "any", frozenset(), ("-DFERRY_PORTABLE=1",),
               "no SIMD intrinsics: the scalar twin every variant is tested against"),
    IsaVariant("avx2", "x86_64", _AVX2, _AVX2_FLAGS, "AVX2 + FMA + F16C (Haswell, Zen 1-3, most laptops)"),
    IsaVariant("avx512", "x86_64", _AVX512, _AVX512_FLAGS, "AVX-512 F/BW/VL/DQ (Skylake-SP)"),
    IsaVariant("avx512_vnni", "x86_64", _AVX512 | {"avx512_vnni"}, _AVX512_FLAGS + ("-mavx512vnni",),
               "AVX-512 + VNNI int8 dot products (Cascade Lake)"),
    IsaVariant("avx512_bf16", "x86_64", _AVX512 | {"avx512_vnni", "avx512_bf16"},
               _AVX512_FLAGS + ("-mavx512vnni", "-mavx512bf16"), "AVX-512 + VNNI + BF16 (Cooper Lake, Zen 4/5)"),
    IsaVariant("amx", "x86_64", _AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
               _AVX512_FLAGS + ("-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
               "AVX-512 + AMX tiles (Sapphire Rapids and later)"),
    IsaVariant("neon", "aarch64", frozenset({"asimd"}), ("-march=armv8-a+simd",),
               "ARM NEON (Graviton 1, Cortex-A72)"),
    IsaVariant("neon_dotprod", "aarch64", frozenset({"asimd", "asimddp"}), ("-march=armv8.2-a+dotprod",),
               "ARM NEON + SDOT int8 dot products (Graviton 2/3, Ampere Altra, Apple silicon)"),
)
BY_NAME = {v.name: v for v in VARIANTS}
# The flags that matter to generated code (ours and inductor's): the cache key of compiled artifacts.
RELEVANT_FLAGS = frozenset().union(*(v.requires for v in VARIANTS)) | {"avx", "sse4_2", "avx512_fp16", "asimddp",
                                                                      "sve", "sve2", "fp16", "bf16", "i8mm"}


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags ("flags" on x86, "Features" on ARM); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class CpuInfo:
    """What the kernels need to know of this CPU: its architecture, model name and flags."""

    arch: str
    model: str
    flags: frozenset[str]

    @staticmethod
    def detect() -> CpuInfo:
        model = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.split(":")[0].strip() in ("model name", "Model", "CPU part"):
                    model = line.partition(":")[2].strip()
                    break
        except OSError:
            pass
        return CpuInfo(platform.machine(), model or platform.processor(), read_cpu_flags())

    def supports(self, variant: IsaVariant) -> bool:
        return variant.arch in ("any", self.arch) and variant.requires <= self.flags

    def supported(self) -> list[IsaVariant]:
        """Variants this CPU runs, lowest first (always at least the portable one)."""
        return [v for v in VARIANTS if self.supports(v)]

    def fingerprint(self) -> str:
        """A short key of the ISA-relevant flags: compiled artifacts are cached per fingerprint."""
        relevant = sorted(self.flags & RELEVANT_FLAGS)
        digest = hashlib.sha256(" ".join([self.arch, *relevant]).encode()).hexdigest()[:12]
        return f"{self.arch}-{self.supported()[-1].name}-{digest}"


@lru_cache(maxsize=1)
def this_cpu() -> CpuInfo:
    return CpuInfo.detect()


def select_variant(cpu: CpuInfo | None = None, forced: str | None = None) -> IsaVariant:
    """The variant to load: FERRYLM_CPU_ISA (or `forced`) if the CPU supports it, else the best one."""
    cpu = cpu or this_cpu()
    name = forced if forced is not None else os.environ.get("FERRYLM_CPU_ISA") or None
    if name is None or name == "auto":
        return cpu.supported()[-1]
    if name not in BY_NAME:
        raise ConfigError(f"FERRYLM_CPU_ISA={name!r} is not a kernel variant; choose auto or one of "
                          f"{', '.join(BY_NAME)}")
    variant = BY_NAME[name]
    if not cpu.supports(variant):
        lacks = (f"the architecture {variant.arch}" if variant.arch not in ("any", cpu.arch)
                 else ", ".join(sorted(variant.requires - cpu.flags)))
        raise ConfigError(f"FERRYLM_CPU_ISA={name}: this CPU ({cpu.model or cpu.arch}) lacks {lacks}")
    return variant
