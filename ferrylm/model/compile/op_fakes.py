"""Fake (meta) kernels for the C++ ops FerryLM registers as torch ops (torch.ops.ferrylm.*), so
torch.compile can trace a step through them: it runs the fake to learn each output's shape."""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_fakes(fakes: dict[str, Callable]) -> None:
    """Register each fake under its op name ("ferrylm::op"); a second load in one process is a no-op."""
    for name, fake in fakes.items():
        try:
            torch.library.register_fake(name)(fake)
        except RuntimeError as e:  # already registered by an earlier load in this process
            if "already has" not in str(e) and "already registered" not in str(e):
                raise
