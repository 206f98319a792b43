"""Was the machine quiet during a timed run? /proc/stat's busy time vs. what the benchmark itself used.

A neighbour's load slows every engine differently (an engine at 1 core suffers less than one at 2),
so a run that shared the CPU is flagged rather than silently compared.
"""

from __future__ import annotations

import os
from pathlib import Path


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; busy excludes idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None  # gone between the listing and the read


def tree_jiffies(root: int) -> int:
    """utime + stime (+ reaped children's) of `root` and every live descendant, threads included:
    vLLM runs its engine core in a child process."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))):
            stats[int(entry)] = st
            children.setdefault(int(st[1]), []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += sum(int(stats[pid][i]) for i in (11, 12, 13, 14))
        todo += children.get(pid, [])
    return total


class CpuWindow:
    """Foreign CPU share over a `with` block: busy jiffies not spent by the worker's process tree or
    this process, as a fraction of the machine's capacity in that window."""

    def __init__(self, worker_pid: int):
        self.pid = worker_pid
        self.foreign_share = 0.0

    def _ours(self) -> int:
        own = _stat(os.getpid()) or []
        return tree_jiffies(self.pid) + sum(int(own[i]) for i in (11, 12))  # not our children: the workers

    def __enter__(self) -> "CpuWindow":
        self.busy0, self.total0 = machine_jiffies()
        self.ours0 = self._ours()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = machine_jiffies()
        ours = self._ours() - self.ours0
        total -= self.total0
        self.foreign_share = max(0.0, (busy - self.busy0 - ours) / total) if total else 0.0


def describe_cpu() -> dict:
    """The machine a figure was measured on: model, cores, the ISA level FerryLM's kernels pick, and
    the ISA-relevant flags (figures from an AVX2 box and an AVX-512 one are not comparable)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from ferrylm.model.cpu.cpu_isa import RELEVANT_FLAGS, this_cpu

    cpu = this_cpu()
    return {"model": cpu.model, "arch": cpu.arch, "cpus": os.cpu_count(), "best_variant": cpu.supported()[-1].name,
            "isa_flags": sorted(cpu.flags & RELEVANT_FLAGS)}
