"""The fault suite's ledger: what happened to every request of a scenario.

Outcomes, from the client's side of the wire:
  completed  200 and the whole answer (a stream's finish_reason and [DONE], or a full JSON body)
  error      an explicit error: an OpenAI error body with a status other than 429/503/500, or an SSE
             `error` event ending a stream that had started
  shed       429 or 503 with an OpenAI error body and Retry-After: refused fast, never accepted
  refused    the connection was refused (a replica that is down or gone): never accepted
  cancelled  the client itself hung up (a disconnect storm): accepted, ended by its owner
  lost       anything else: a stream that stops without [DONE] or an error event, a reset
             connection after the answer began, a 500, a body that is not the API's. Must be 0.

`accepted` counts every request the server took (all but shed and refused).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

OUTCOMES = ("completed", "error", "shed", "refused", "cancelled", "lost")


@dataclass
class Ledger:
    scenario: str
    counts: Counter = field(default_factory=Counter)
    lost_details: list[str] = field(default_factory=list)
    shed_ms: list[float] = field(default_factory=list)
    leaked_blocks: int | None = None  # KV blocks still held once every server is idle (None: not measured)
    recovery_s: float | None = None  # fault → the service answering normally again
    notes: list[str] = field(default_factory=list)

    def record(self, outcome: str, detail: str = "", latency_ms: float | None = None) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        self.counts[outcome] += 1
        if outcome == "lost":
            self.lost_details.append(detail)
        if outcome == "shed" and latency_ms is not None:
            self.shed_ms.append(latency_ms)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def accepted(self) -> int:
        return self.total - self.counts["shed"] - self.counts["refused"]

    def shed_p99_ms(self) -> float | None:
        if not self.shed_ms:
            return None
        ordered = sorted(self.shed_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def assert_guarantee(self) -> None:
        """The published guarantee: nothing lost, no KV block leaked."""
        assert self.counts["lost"] == 0, f"{self.scenario}: {self.counts['lost']} lost: {self.lost_details[:5]}"
        assert self.leaked_blocks in (0, None), f"{self.scenario}: {self.leaked_blocks} KV blocks leaked"

    def row(self) -> dict[str, object]:
        p99 = self.shed_p99_ms()
        return {"scenario": self.scenario, "requests": self.total, "accepted": self.accepted,
                "completed": self.counts["completed"], "explicit_error": self.counts["error"],
                "cancelled": self.counts["cancelled"], "shed": self.counts["shed"],
                "refused": self.counts["refused"], "lost": self.counts["lost"],
                "leaked_blocks": "-" if self.leaked_blocks is None else self.leaked_blocks,
                "shed_p99_ms": "-" if p99 is None else round(p99, 1),
                "recovery_s": "-" if self.recovery_s is None else round(self.recovery_s, 2)}

    def merged(self, other: "Ledger") -> "Ledger":
        """Two runs of one scenario as one ledger (the campaign repeats scenarios)."""
        leaked = None if self.leaked_blocks is None and other.leaked_blocks is None else \
            (self.leaked_blocks or 0) + (other.leaked_blocks or 0)
        recoveries = [r for r in (self.recovery_s, other.recovery_s) if r is not None]
        return dataclasses.replace(self, counts=self.counts + other.counts,
                                   lost_details=self.lost_details + other.lost_details,
                                   shed_ms=self.shed_ms + other.shed_ms, leaked_blocks=leaked,
                                   recovery_s=max(recoveries) if recoveries else None,
                                   notes=self.notes + other.notes)
