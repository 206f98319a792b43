"""The ARM NEON kernels (quant/csrc/neon_gemv.h, attention/csrc/neon_decode.h) on an emulated ARM CPU.

There is no aarch64 torch here, so the headers are torch-free and tests/csrc/neon_kernels_test.cpp
checks them against scalar references: it is cross-compiled with `aarch64-linux-gnu-g++` twice,
for ARMv8.2 with the dot-product extension (SDOT) and for plain ARMv8.0 (SMULL + SADALP), and each
binary runs under qemu-user on a CPU model that has exactly what it was built for: Neoverse-N1
(Graviton2, has dotprod) and Cortex-A72 (Graviton1, has not, so a stray SDOT would be an illegal
instruction). The headers must also be empty off ARM and in the portable build (FERRY_PORTABLE).

Needs the Debian packages g++-aarch64-linux-gnu and qemu-user; skipped with the reason where absent.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "csrc" / "neon_kernels_test.cpp"
HEADERS = (ROOT / "ferrylm" / "model" / "quant" / "csrc" / "neon_gemv.h",
           ROOT / "ferrylm" / "model" / "attention" / "csrc" / "neon_decode.h")
CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", Path("/usr/aarch64-linux-gnu")
# build name: (-march, the qemu CPU model to run it on, what __ARM_FEATURE_DOTPROD should be)
BUILDS = {"dotprod": ("-march=armv8.2-a+dotprod", "neoverse-n1", 1),
          "armv8": ("-march=armv8-a", "cortex-a72", 0)}


def _need(*tools: str) -> None:
    hints = {CROSS: "apt-get install g++-aarch64-linux-gnu", QEMU: "apt-get install qemu-user", "g++": "a host g++"}
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found ({hints[tool]})")
    if CROSS in tools and not (SYSROOT / "lib").is_dir():
        pytest.skip(f"no aarch64 sysroot at {SYSROOT} (apt-get install g++-aarch64-linux-gnu)")


@pytest.fixture(scope="module")
def binaries(tmp_path_factory) -> dict[str, Path]:
    """Both builds of the driver, compiled side by side (each takes ~5-10 s of one core)."""
    _need(CROSS, QEMU)
    out = tmp_path_factory.mktemp("neon")
    procs = {}
    for name, (march, _, _) in BUILDS.items():
        cmd = [CROSS, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", march, str(DRIVER), "-o", str(out / name)]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{CROSS} {BUILDS[name][0]} failed:\n{logs[name]}"
    return {name: out / name for name in BUILDS}


@pytest.mark.parametrize("build", list(BUILDS))
def test_neon_kernels_match_the_scalar_references_under_qemu(build, binaries):
    march, cpu, dotprod = BUILDS[build]
    run = subprocess.run([QEMU, "-cpu", cpu, "-L", str(SYSROOT), str(binaries[build])], capture_output=True,
                         text=True, timeout=180)
    report = run.stdout + run.stderr
    assert run.returncode == 0, f"{march} on {cpu}: exit {run.returncode}\n{report}"
    assert f"dotprod={dotprod}" in report, report
    assert "PASS:" in report and " 0 failed" in report, report


def test_the_dotprod_build_uses_sdot_and_the_plain_one_does_not(binaries):
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump not found (binutils-aarch64-linux-gnu)")
    counts = {}
    for name, path in binaries.items():
        text = subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
        counts[name] = sum(1 for line in text.splitlines() if "\tsdot\t" in line)
    assert counts["dotprod"] > 0 and counts["armv8"] == 0, counts


def _inert_probe(tmp_path: Path, expect_active: bool) -> Path:
    """A translation unit including both headers that fails to compile unless their guard macros are
    defined exactly when expected."""
    src = tmp_path / f"probe_{int(expect_active)}.cpp"
    includes = "\n".join(f'#include "{h}"' for h in HEADERS)
    want = "!" if expect_active else ""
    src.write_text(f"{includes}\n#if {want}(defined(FERRY_NEON_GEMV) || defined(FERRY_NEON_DECODE))\n"
                   f"#error NEON kernels {'missing' if expect_active else 'compiled in'}\n#endif\nint main() {{}}\n")
    return src


@pytest.mark.parametrize("flags", [[], ["-mavx2", "-mfma", "-mf16c"], ["-mavx512f", "-mavx512bw"]],
                         ids=["x86-64", "avx2", "avx512"])
def test_the_headers_are_empty_off_arm(flags, tmp_path):
    _need("g++")
    src = _inert_probe(tmp_path, expect_active=False)
    run = subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", *flags, "-c", str(src), "-o", str(tmp_path / "p.o")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    syms = subprocess.run(["nm", "-C", str(tmp_path / "p.o")], capture_output=True, text=True).stdout
    assert "ferry_neon" not in syms, syms


@pytest.mark.parametrize(("flags", "active"), [(["-march=armv8-a+simd"], True),
                                               (["-march=armv8-a+simd", "-DFERRY_PORTABLE=1"], False)],
                         ids=["neon-variant", "portable-variant"])
def test_the_headers_follow_the_variant_flags_on_arm(flags, active, tmp_path):
    _need(CROSS)
    src = _inert_probe(tmp_path, expect_active=active)
    run = subprocess.run([CROSS, "-std=c++17", "-Wall", "-Werror", *flags, "-fsyntax-only", str(src)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
