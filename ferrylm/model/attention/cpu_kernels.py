"""Loads the C++ CPU kernels (built once with torch's extension tools, cached on disk).

If no compiler is available the build fails once and callers fall back to plain torch.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("ferrylm.kernels")

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "fused_ops.cpp")]


@lru_cache(maxsize=1)
def load_cpu_kernels():
    """The compiled module, or None if it cannot be built here (then torch-native is used)."""
    if os.environ.get("FERRYLM_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="ferrylm_cpu_kernels", sources=[str(p) for p in _SOURCES], extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("CPU attention kernel unavailable, using plain torch: %s", e)
        return None
