"""Building FerryLM's C++ extensions, which register torch ops (torch.ops.ferrylm.*), and their fake
(meta) kernels, which torch.compile runs to learn each output's shape when it traces a step through
them. Shared by attention/cpu_kernels.py and quant/kernels.py."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

log = logging.getLogger("ferrylm.kernels")


def register_fakes(fakes: dict[str, Callable]) -> None:
    """Register each fake under its op name ("ferrylm::op"); a second load in one process is a no-op."""
    for name, fake in fakes.items():
        try:
            torch.library.register_fake(name)(fake)
        except RuntimeError as e:  # already registered by an earlier load in this process
            if "already has" not in str(e) and "already registered" not in str(e):
                raise


def build_extension(name: str, sources: Sequence[Path], cflags: list[str], fakes: dict[str, Callable],
                    what: str, disable_env: str, python_module: bool = True):
    """Build (once; torch caches it on disk) and load extension `name`, then register its fakes.

    Returns the Python module (python_module=True) or, for a library of ops only, torch.ops.ferrylm;
    None when `disable_env` is set or it cannot be built here (a warning naming `what`): the callers
    then fall back to plain torch."""
    if os.environ.get(disable_env):
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name=name, sources=[str(p) for p in sources], extra_cflags=cflags, extra_ldflags=["-fopenmp"],
                      is_python_module=python_module, verbose=False)
        register_fakes(fakes)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("%s unavailable, using plain torch: %s", what, e)
        return None
    return module if python_module else torch.ops.ferrylm
