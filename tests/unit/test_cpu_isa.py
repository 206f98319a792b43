"""Kernel variants are chosen from what the CPU reports, and a cache built on another CPU is never run.

The CPUs here are simulated (CpuInfo with the flags /proc/cpuinfo would show), so these tests hold
on any machine; the variants the running CPU supports are built and compared in
tests/model/test_quant_variants.py and tests/unit/test_cpu_kernel_variants.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrylm.config import ConfigError
from ferrylm.model.compile import compile_cache
from ferrylm.model.cpu import cpu_isa, kernel_build
from ferrylm.model.cpu.cpu_isa import BY_NAME, CpuInfo, read_cpu_flags, select_variant

AVX2_ONLY = CpuInfo("x86_64", "AMD EPYC 7B12", frozenset(
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt".split()))
AVX512_BF16 = CpuInfo("x86_64", "AMD EPYC 9B14", AVX2_ONLY.flags | frozenset(
    "avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16".split()))
SAPPHIRE = CpuInfo("x86_64", "Intel Xeon 8481C", AVX512_BF16.flags | {"amx_tile", "amx_bf16", "amx_int8"})
GRAVITON = CpuInfo("aarch64", "Neoverse-V1", frozenset("fp asimd evtstrm aes crc32 asimddp sve".split()))
CORTEX_A72 = CpuInfo("aarch64", "Cortex-A72", frozenset("fp asimd evtstrm crc32".split()))
OLD_X86 = CpuInfo("x86_64", "QEMU Virtual CPU", frozenset("fpu sse sse2".split()))


@pytest.mark.parametrize(("cpu", "best"), [(AVX2_ONLY, "avx2"), (AVX512_BF16, "avx512_bf16"), (SAPPHIRE, "amx"),
                                           (GRAVITON, "neon_dotprod"), (CORTEX_A72, "neon"),
                                           (OLD_X86, "portable")])
def test_best_variant_follows_the_cpu_flags(cpu, best, monkeypatch):
    monkeypatch.delenv("FERRYLM_CPU_ISA", raising=False)
    assert select_variant(cpu).name == best
    assert cpu.supported()[0].name == "portable"  # the twin runs everywhere


def test_a_variant_can_be_forced_down_but_never_up(monkeypatch):
    monkeypatch.setenv("FERRYLM_CPU_ISA", "avx2")
    assert select_variant(AVX512_BF16).name == "avx2"
    assert select_variant(AVX512_BF16, forced="portable").name == "portable"
    with pytest.raises(ConfigError, match="lacks avx512_bf16"):
        select_variant(AVX2_ONLY, forced="avx512_bf16")
    with pytest.raises(ConfigError, match="architecture aarch64"):
        select_variant(AVX512_BF16, forced="neon")
    with pytest.raises(ConfigError, match="not a kernel variant"):
        select_variant(AVX2_ONLY, forced="sse9")


def test_cpuinfo_flags_are_read_on_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma f16c\n\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd40\n")
    assert read_cpu_flags(x86) == {"fpu", "sse", "avx2", "fma", "f16c"}
    assert read_cpu_flags(arm) == {"fp", "asimd", "asimddp"}
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_variant_flags_never_ask_the_compiler_for_the_build_machine():
    for variant in cpu_isa.VARIANTS:
        assert not any("native" in flag for flag in variant.cflags), variant.name
    lower = [v for v in cpu_isa.VARIANTS if v.arch == "x86_64"]
    for a, b in zip(lower, lower[1:]):  # each x86 level adds to the one below
        assert a.requires < b.requires and set(a.cflags) < set(b.cflags)
    assert BY_NAME["neon"].requires < BY_NAME["neon_dotprod"].requires


def test_compiled_steps_of_different_cpus_live_apart(monkeypatch, tmp_path):
    """inductor's generated C++ uses the compiling CPU's instructions: an AVX-512 machine's cache, copied
    to an AVX2 machine, sits in a directory the AVX2 machine never reads."""
    monkeypatch.setenv("FERRYLM_CACHE_DIR", str(tmp_path))
    dirs = {cpu.fingerprint(): compile_cache.compile_cache_dir(cpu) for cpu in (AVX2_ONLY, AVX512_BF16, SAPPHIRE)}
    assert len(set(dirs.values())) == 3
    assert compile_cache.compile_cache_dir(AVX2_ONLY).name.startswith("x86_64-avx2-")
    # an irrelevant flag (a new vulnerability mitigation) does not invalidate the cache
    assert CpuInfo("x86_64", "x", AVX2_ONLY.flags | {"md_clear"}).fingerprint() == AVX2_ONLY.fingerprint()


def _copied_build(root: Path, library: str, variant: str) -> Path:
    """A build directory as an AVX-512 machine leaves it (a .so and the manifest beside it)."""
    build = root / f"{library}-{variant}"
    build.mkdir(parents=True)
    (build / f"{library}_{variant}.so").write_bytes(b"\x7fELF not for this CPU")
    (build / kernel_build.MANIFEST).write_text(json.dumps({"variant": variant,
                                                           "requires": sorted(BY_NAME[variant].requires)}))
    return build


def test_a_build_copied_from_an_avx512_machine_is_never_loaded_on_avx2(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRYLM_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FERRYLM_CPU_ISA", raising=False)
    root = kernel_build.kernel_cache_dir()
    build = _copied_build(root, "ferrylm_quant_ops", "avx512_bf16")
    loads = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: loads.append(kw))
    # The AVX2 machine picks its own variant, in its own directory ...
    assert select_variant(AVX2_ONLY).name == "avx2"
    # ... and asked for the copied one, refuses before loading anything.
    with pytest.raises(kernel_build.ForeignBuildError, match="avx512"):
        kernel_build.build_library("ferrylm_quant_ops", [], BY_NAME["avx512_bf16"], cpu=AVX2_ONLY)
    # A copied directory renamed to look like an AVX2 build still carries its manifest.
    build.rename(root / "ferrylm_quant_ops-avx2")
    with pytest.raises(kernel_build.ForeignBuildError, match="avx512_bf16"):
        kernel_build.build_library("ferrylm_quant_ops", [], BY_NAME["avx2"], cpu=AVX2_ONLY)
    assert loads == []


def test_a_matching_build_is_loaded_with_explicit_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRYLM_KERNEL_CACHE_DIR", str(tmp_path))
    loads = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: loads.append(kw))
    kernel_build.build_library("ferrylm_quant_ops", [Path("a.cpp")], BY_NAME["avx2"], cpu=AVX512_BF16)
    (call,) = loads
    assert call["name"] == "ferrylm_quant_ops_avx2"
    assert "-mavx2" in call["extra_cflags"] and not any("avx512" in f for f in call["extra_cflags"])
    assert "-DFERRY_LIB=ferrylm_avx2" in call["extra_cflags"]
    manifest = json.loads((Path(call["build_directory"]) / kernel_build.MANIFEST).read_text())
    assert manifest["variant"] == "avx2" and set(manifest["requires"]) == {"avx2", "fma", "f16c"}
