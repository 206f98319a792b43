"""The CPU priority of FerryLM's background processes (grammar compiles, decode-graph compiles).

On a CPU the engine's OpenMP threads want every core each step, and a barrier waits for the slowest
thread: a busy process at normal priority, or even at nice +10, that keeps a core for a scheduler
tick makes a 25 ms decode step take hundreds of milliseconds (bench/RESULTS.md, "M3.2 background
priority"). At nice +19 (1.5% of a normal thread's share when both want a core) the step is close to
undisturbed, and the process still progresses under load, which SCHED_IDLE does not promise: a
grammar compile has a budget and a start timeout. Children (inductor's compile pool) inherit it."""

from __future__ import annotations

import os
import shutil
import sys

NICENESS = 19


def yield_cpu_to_serving() -> int:
    """Lower this process (and its future children) to NICENESS; the niceness it got."""
    try:
        return os.nice(NICENESS - os.nice(0))
    except OSError:
        return os.nice(0)


def background_python(module: str) -> list[str]:
    """The command line of `python -m module` started at NICENESS already (coreutils' `nice` where
    there is one): the child's interpreter start-up and imports run before it can lower itself, and a
    grammar worker is restarted after every compile that is stopped, so that start-up would otherwise
    take a core from a decode step at normal priority each time."""
    argv = [sys.executable, "-m", module]
    nice = shutil.which("nice")
    return [nice, "-n", str(NICENESS), *argv] if nice and os.name == "posix" else argv
