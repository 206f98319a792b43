"""How many OpenMP threads the CPU model step runs on.

One per physical core this process may use: SMT siblings share a core's vector units, so a
second thread per core adds barrier waits to every op and no GEMM throughput; CPUs outside the
affinity mask (taskset, cpusets) or beyond a cgroup CPU quota (a container's --cpus) are not
ours, and threads past them make every parallel region wait for a descheduled thread. The HTTP
event loop and the tokenizer threads mostly sleep, and on small machines giving them a core of
their own costs more decode throughput than it saves, so none is reserved.

The default only ever lowers torch's own count (all logical CPUs), so a torch.set_num_threads(n)
made before the engine starts stands. FERRYLM_CPU_THREADS=n sets the count outright;
OMP_NUM_THREADS, if set, is left to torch.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger("ferrylm.threads")

_SYS_CPU = Path("/sys/devices/system/cpu")
_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def physical_cores(cpus: set[int], sys_cpu: Path = _SYS_CPU) -> int:
    """Distinct (package, core) pairs among `cpus`; len(cpus) where the topology is not readable."""
    cores = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cgroup_cpu_limit(cpu_max: Path = _CPU_MAX) -> int | None:
    """CPUs granted by a cgroup v2 quota ("200000 100000" → 2), None when unlimited or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def default_cpu_threads() -> int:
    """Physical cores in this process's affinity mask, capped by a cgroup CPU quota."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    threads = physical_cores(cpus)
    limit = cgroup_cpu_limit()
    return min(threads, limit) if limit is not None else threads


def configure_cpu_threads(environ: dict[str, str] | None = None) -> int:
    """Set torch's intra-op threads (FERRYLM_CPU_THREADS, else OMP_NUM_THREADS via torch, else at
    most default_cpu_threads()) and return the count. Call before compiling: generated code bakes
    the count in."""
    env = os.environ if environ is None else environ
    requested = env.get("FERRYLM_CPU_THREADS")
    if requested:
        threads = int(requested)
        if threads < 1:
            raise ValueError(f"FERRYLM_CPU_THREADS must be a positive integer, got {requested!r}")
    elif env.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    else:
        threads = min(torch.get_num_threads(), default_cpu_threads())
    if threads != torch.get_num_threads():
        log.info("CPU threads: %d (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
    return threads
