"""Whether anything else used the CPU during a timed run: /proc/stat's busy time minus this process's."""

from __future__ import annotations

from pathlib import Path


def _jiffies() -> tuple[int, int]:
    """(busy jiffies of everything but this process, all jiffies) so far."""
    machine = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return sum(machine) - machine[3] - machine[4] - int(own[11]) - int(own[12]), sum(machine)


class ForeignCpu:
    """`with ForeignCpu() as cpu: ...` then `cpu.share`: the machine's CPU others used meanwhile."""

    share: float = 0.0

    def __enter__(self) -> "ForeignCpu":
        self._start = _jiffies()
        return self

    def __exit__(self, *exc) -> None:
        foreign, total = (b - a for a, b in zip(self._start, _jiffies()))
        self.share = max(0.0, foreign / max(1, total))
