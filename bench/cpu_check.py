"""Whether anything else used the CPU during a timed run: /proc/stat's busy time minus this process's."""

from __future__ import annotations

from pathlib import Path


def _jiffies(exclude_pids: tuple[int, ...] = (), children: bool = False) -> tuple[int, int]:
    """(busy jiffies of everything but this process and `exclude_pids`, all jiffies) so far.
    `children`: also not this process's waited-for children (servers a campaign started and stopped)."""
    machine = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    own = 0
    for stat in ["/proc/self/stat", *(f"/proc/{pid}/stat" for pid in exclude_pids)]:
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        own += int(fields[11]) + int(fields[12])
        if children and stat == "/proc/self/stat":
            own += int(fields[13]) + int(fields[14])  # cutime, cstime
    return sum(machine) - machine[3] - machine[4] - own, sum(machine)


class ForeignCpu:
    """`with ForeignCpu() as cpu: ...` then `cpu.share`: the machine's CPU others used meanwhile.
    `exclude_pids`: processes of the measured run itself (tensor-parallel ranks)."""

    share: float = 0.0

    def __init__(self, exclude_pids: list[int] | tuple[int, ...] = (), children: bool = False):
        self.exclude_pids = tuple(exclude_pids)
        self.children = children  # count the run's own (reaped) child processes as the run

    def __enter__(self) -> "ForeignCpu":
        self._start = _jiffies(self.exclude_pids, self.children)
        return self

    def __exit__(self, *exc) -> None:
        foreign, total = (b - a for a, b in zip(self._start, _jiffies(self.exclude_pids, self.children)))
        self.share = max(0.0, foreign / max(1, total))
