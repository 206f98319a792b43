"""The CPU priority of FerryLM's background processes (grammar compiles, decode-graph compiles).

On a CPU the engine's OpenMP threads want every core each step, and a barrier waits for the slowest
thread: a busy process at normal priority, or even at nice +10, that keeps a core for a scheduler
tick makes a 25 ms decode step take hundreds of milliseconds (bench/RESULTS.md, "M3.2 background
priority"). At nice +19 (1.5% of a normal thread's share when both want a core) the step is close to
undisturbed, and the process still progresses under load, which SCHED_IDLE does not promise: a
grammar compile has a budget and a start timeout. Children (inductor's compile pool) inherit it."""

from __future__ import annotations

import os

NICENESS = 19


def yield_cpu_to_serving() -> int:
    """Lower this process (and its future children) to NICENESS; the niceness it got."""
    try:
        return os.nice(NICENESS - os.nice(0))
    except OSError:
        return os.nice(0)
