"""Builds one C++ kernel library for one instruction-set variant (cpu_isa.py) and loads it.

The build lives in $FERRYLM_KERNEL_CACHE_DIR/<torch>-<python>/<library>-<variant>/ (default
~/.cache/ferrylm/kernels; apart from FERRYLM_CACHE_DIR's compiled steps, which tests point at empty
directories without wanting a kernel rebuild each time), next to a manifest naming the CPU flags its
code may use. A build is loaded only when this CPU has every one of them, so a cache directory
shared between machines (a container image, NFS home) never hands an AVX2 machine an AVX-512
library. torch's extension loader rebuilds
when the sources or flags change.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from ferrylm.model.cpu.cpu_isa import CpuInfo, IsaVariant, this_cpu

log = logging.getLogger("ferrylm.kernels")

MANIFEST = "ferrylm-variant.json"


def kernel_cache_dir() -> Path:
    root = Path(os.environ.get("FERRYLM_KERNEL_CACHE_DIR", Path.home() / ".cache" / "ferrylm" / "kernels"))
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}"
    return root / tag


def op_namespace(variant: IsaVariant) -> str:
    """The torch.ops namespace a variant's library registers its ops in."""
    return f"ferrylm_{variant.name}"


class ForeignBuildError(RuntimeError):
    """A cached build needs CPU flags this machine lacks (copied from another machine)."""


def check_manifest(build_dir: Path, variant: IsaVariant, cpu: CpuInfo) -> None:
    """Refuse a build directory whose manifest asks for more than this CPU has, or that belongs to
    another variant. A directory without a manifest is treated as unknown and rebuilt."""
    path = build_dir / MANIFEST
    if not path.exists():
        return
    try:
        manifest = json.loads(path.read_text())
        requires = frozenset(manifest["requires"])
        name = manifest["variant"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ForeignBuildError(f"unreadable kernel manifest {path}: {e}") from e
    if name != variant.name or not requires <= cpu.flags:
        raise ForeignBuildError(f"{build_dir} holds a {name!r} build needing {sorted(requires - cpu.flags)}, "
                                f"which this CPU ({cpu.model or cpu.arch}) lacks")


def build_library(library: str, sources: list[Path], variant: IsaVariant, extra_cflags: tuple[str, ...] = (),
                  cpu: CpuInfo | None = None) -> None:
    """Build (or reuse) and load `library` for `variant`; its ops register under op_namespace(variant).
    Raises ForeignBuildError for a cached build this CPU must not run; build failures propagate."""
    from torch.utils.cpp_extension import load

    cpu = cpu or this_cpu()
    if not cpu.supports(variant):
        raise ForeignBuildError(f"the {variant.name} kernels need {sorted(variant.requires - cpu.flags)}")
    build_dir = kernel_cache_dir() / f"{library}-{variant.name}"
    check_manifest(build_dir, variant, cpu)
    build_dir.mkdir(parents=True, exist_ok=True)
    cflags = ["-O3", "-fopenmp", f"-DFERRY_LIB={op_namespace(variant)}", *variant.cflags, *extra_cflags]
    load(name=f"{library}_{variant.name}", sources=[str(p) for p in sources], extra_cflags=cflags,
                  extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False,
                  verbose=False)
    (build_dir / MANIFEST).write_text(json.dumps({"variant": variant.name, "requires": sorted(variant.requires),
                                                  "cflags": cflags}))
