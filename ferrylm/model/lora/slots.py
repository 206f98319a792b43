"""Resident adapters' matrices stacked per Linear, and the step's rows grouped by adapter: each
Linear adds (x[rows] A^T) B^T to every adapter's rows with one gather, two batched matmuls over all
the step's adapters and one scatter-add (the SGMV idea: no per-request or per-adapter loop; rows
padded to the largest group). Base-model rows are in no group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepGroups:
    """The current forward's rows by slot, padded to one width so that every Linear runs one batched
    matmul pair over all adapters of the step: `rows` [G·M] indexes the flat batch (padding points
    at row 0), `keep` [G, M, 1] zeroes the padding's deltas, `slots` [G] the slots in use (None:
    every slot, in order). Empty `rows`: no adapter in this step (the Linears skip LoRA)."""

    rows: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    slots: torch.Tensor | None = None

    @classmethod
    def build(cls, by_slot: dict[int, list[int]], num_slots: int, dtype: torch.dtype,
              device: torch.device | str) -> "StepGroups":
        if not by_slot:
            return cls()
        order = sorted(by_slot)
        width = max(len(r) for r in by_slot.values())
        rows = [r + [0] * (width - len(r)) for r in (by_slot[s] for s in order)]
        keep = [[1.0] * len(by_slot[s]) + [0.0] * (width - len(by_slot[s])) for s in order]
        every = order == list(range(num_slots))
        return cls(torch.tensor(rows, dtype=torch.int64, device=device).flatten(),
                   torch.tensor(keep, dtype=dtype, device=device).unsqueeze(-1),
                   None if every else torch.tensor(order, dtype=torch.int64, device=device))


class LoRASlots:
    """One fused Linear's adapter slots: A^T [S, in, n·r] and B^T [S, n·r, out] for n output slices
    (q/k/v, gate/up or one), slice i's rank-r block at columns i·r.. (block diagonal, zeros where an
    adapter does not target the slice or has a smaller rank)."""

    def __init__(self, step: "StepHolder", num_slots: int, max_rank: int, in_features: int,
                 slice_sizes: list[int], dtype: torch.dtype, device: torch.device | str):
        self.step, self.max_rank, self.slice_sizes = step, max_rank, slice_sizes
        width = max_rank * len(slice_sizes)
        self.a_t = torch.zeros(num_slots, in_features, width, dtype=dtype, device=device)
        self.b_t = torch.zeros(num_slots, width, sum(slice_sizes), dtype=dtype, device=device)

    def write(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A, B) per slice index into `slot` (untargeted slices stay zero)."""
        self.a_t[slot].zero_()
        self.b_t[slot].zero_()
        for index, (a, b) in slices.items():
            col, row = index * self.max_rank, sum(self.slice_sizes[:index])
            self.a_t[slot, :, col:col + a.shape[0]] = a.T
            self.b_t[slot, col:col + b.shape[1], row:row + b.shape[0]] = b.T

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus, on each adapter's rows, (x A^T) B^T: gather, two batched matmuls, scatter-add."""
        groups = self.step.groups
        assert groups.rows is not None and groups.keep is not None
        a_t, b_t = self.a_t, self.b_t
        if groups.slots is not None:
            a_t, b_t = a_t.index_select(0, groups.slots), b_t.index_select(0, groups.slots)
        num, width = groups.keep.shape[0], groups.keep.shape[1]
        xg = x.index_select(0, groups.rows).view(num, width, -1)
        delta = torch.bmm(torch.bmm(xg, a_t) * groups.keep, b_t)
        return y.index_add_(0, groups.rows, delta.view(num * width, -1))


@dataclass
class StepHolder:
    """What every LoRASlots of a model reads: the current step's groups (set per forward)."""

    groups: StepGroups = field(default_factory=StepGroups)
