"""The CPU priority of FerryLM's background processes (grammar compiles, decode-graph compiles).

On a CPU the engine's OpenMP threads want every core each step, and a barrier waits for the slowest
thread: a busy process at normal priority, or even at nice +10, that keeps a core for a scheduler
tick makes a 25 ms decode step take hundreds of milliseconds (bench/RESULTS.md, "M3.2 background
priority"). So background processes run under SCHED_IDLE where the OS has it (Linux): a waking
serving thread, or a client's process, preempts them at once, and a core running only them counts
as idle when the scheduler places a waking thread. A niceness of +19 alone still let a compile keep
its core for a time slice: with compile bombs beside a served stream the stream's median inter-token
gap rose 25 → 28 ms at nice +19 and stayed at 25 ms under SCHED_IDLE (RESULTS, "M3.2 hostile tenant:
SCHED_IDLE compile workers"). They still progress whenever a core is free, which between decode
steps one is. Elsewhere they run at nice +19. Children (inductor's compile pool) inherit both."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

NICENESS = 19


def yield_cpu_to_serving() -> int:
    """Lower this process (and its future children) to NICENESS and, where the OS has it, SCHED_IDLE;
    the niceness it got."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    try:
        return os.nice(NICENESS - os.nice(0))
    except OSError:
        return os.nice(0)


def background_python(module: str, *args: str) -> list[str]:
    """The command line of `python -m module args...` lowered already: under SCHED_IDLE (util-linux's
    `chrt -i 0`) where there is one, and at NICENESS (coreutils' `nice`). The child's interpreter
    start-up and imports run before it could lower itself, and a grammar worker is restarted after
    every compile that is stopped, so that start-up would otherwise take a core from a decode step at
    normal priority each time."""
    argv = [sys.executable, "-m", module, *args]
    if os.name != "posix":
        return argv
    nice = shutil.which("nice")
    if nice:
        argv = [nice, "-n", str(NICENESS), *argv]
    return [*_sched_idle_prefix(), *argv]


@functools.cache
def _sched_idle_prefix() -> tuple[str, ...]:
    """`chrt --idle 0` if it works here (a container's seccomp profile may refuse the call: then the
    child still lowers itself first thing, yield_cpu_to_serving), else nothing."""
    chrt = shutil.which("chrt")
    if chrt is None or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([chrt, "--idle", "0", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (chrt, "--idle", "0") if ok else ()
