"""Compiled decode steps on disk: where they live, the key that says when one may be reused, and
saving / loading them (torch's AOTCompiledFunction, from torch.compile(...).aot_compile).

A saved step is a traced graph plus generated C++: it is valid only for the same module tree
(quantization layouts included), parameter and KV cache shapes, input shapes, torch build, CPU and
thread count (inductor bakes the thread count into its parallel loops): `step_key` hashes them
all. The Python it was traced from is checked on load instead (`sources_unchanged`): an edit to
any module the trace went through compiles afresh, an edit elsewhere does not.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ferrylm.model.cpu.cpu_isa import CpuInfo, select_variant, this_cpu

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction

log = logging.getLogger("ferrylm.compile")


def compile_cache_dir(cpu: CpuInfo | None = None) -> Path:
    """$FERRYLM_CACHE_DIR/compiled/<CPU fingerprint> (default ~/.cache/ferrylm/...): inductor's generated
    C++ uses every instruction the compiling CPU has, so a cache copied to a machine with other ISA
    flags (an AVX-512 build on an AVX2 host) lands in another directory and is never loaded there."""
    root = Path(os.environ.get("FERRYLM_CACHE_DIR", Path.home() / ".cache" / "ferrylm"))
    return root / "compiled" / (cpu or this_cpu()).fingerprint()


def sources_unchanged(step) -> bool:
    """True when every module a loaded step (torch's AOTCompiledFunction) was traced through
    still has the source it had then."""
    for source in step.source_info().inlined_sources:
        try:
            module = sys.modules.get(source.module) or importlib.import_module(source.module)
            if inspect.getsource(module) != source.content:
                return False
        except (ImportError, OSError, TypeError):
            return False
    return True


def _tensor_sig(t: torch.Tensor) -> str:
    return f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.device.type}"


def step_key(model: nn.Module, kv_caches: list, inputs: tuple[torch.Tensor, ...], options: dict) -> str:
    """A short hex digest of everything a compiled step of `model` over these inputs depends on."""
    parts = [torch.__version__, str(torch.version.git_version), platform.machine(),
             torch.backends.cpu.get_cpu_capability(), this_cpu().fingerprint(), select_variant().name,
             str(torch.get_num_threads()),
             repr(sorted(options.items())), repr(model), repr(getattr(model, "config", None)),
             type(getattr(model, "attn_backend", None)).__name__,
             repr(sorted({type(getattr(m, "fused_ops", None)).__name__ for m in model.modules()}))]
    parts += [f"{name}:{_tensor_sig(t)}" for name, t in model.named_parameters(remove_duplicate=False)]
    parts += [f"{name}:{_tensor_sig(t)}" for name, t in model.named_buffers(remove_duplicate=False)]
    parts += [_tensor_sig(t) for layer in kv_caches for t in layer]
    parts += [_tensor_sig(t) for t in inputs]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def save_step(step, path: Path) -> None:
    """Write a freshly compiled step to `path` (atomically: a crash leaves no half file)."""
    step.save_compiled_function(str(path))


def load_step(path: Path, args: tuple, f_globals: dict):
    """The step saved at `path` if it exists, loads, was traced from today's code and its guards
    accept `args`; else None (then it is compiled afresh and overwritten). `f_globals`: the globals
    of the module whose function was compiled."""
    if not path.exists():
        return None
    try:
        with path.open("rb") as f:
            # an AOTCompiledFunction (torch's stub says only Callable)
            step = cast("AOTCompiledFunction", torch.compiler.load_compiled_function(f, f_globals=f_globals))
        if not sources_unchanged(step):
            raise ValueError("the code it was traced from has changed")
        if not step.guard_check(*args):
            raise ValueError("its guards reject this model's inputs")
    except Exception as e:  # noqa: BLE001 - a stale or foreign artifact: compile afresh
        log.warning("compiled decode step %s unusable (%s); recompiling", path.name, e)
        return None
    return step


@contextmanager
def inductor_cache_dir(path: Path) -> Iterator[None]:
    """Inductor's own cache (generated C++ and its .so files) under `path` while compiling or loading,
    unless TORCHINDUCTOR_CACHE_DIR says otherwise; the process environment is restored afterwards."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
