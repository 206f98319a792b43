"""Voluntary context switches of a process, all its threads summed (Linux /proc): how often its threads
went to sleep. An OpenMP barrier that spins shows none; one that sleeps shows one per wait."""

from __future__ import annotations

from pathlib import Path


def voluntary_switches(pid: int | str = "self") -> int:
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            total += sum(int(line.split()[1]) for line in status.read_text().splitlines()
                         if line.startswith("voluntary_ctxt_switches"))
        except OSError:
            continue  # a thread that ended meanwhile
    return total
