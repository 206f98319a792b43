"""Resident adapters' matrices stacked per Linear, and the step's rows grouped by adapter: each
Linear adds, per adapter in the step, (x[rows] A^T) B^T to its rows (gather by adapter, two
matmuls each: the SGMV idea without a per-request loop). Base-model rows are in no group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepGroups:
    """The current forward's rows per slot: (slot, row indices). Set by the model before each
    forward from its ForwardBatch; empty: no adapter in this step (the Linears skip LoRA)."""

    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoRASlots:
    """One fused Linear's adapter slots: A [S, n·r, in] and B [S, out, n·r] for n output slices
    (q/k/v, gate/up or one), slice i's rank-r block at columns i·r.. (block diagonal, zeros where an
    adapter does not target the slice or has a smaller rank)."""

    def __init__(self, step: StepGroups, num_slots: int, max_rank: int, in_features: int,
                 slice_sizes: list[int], dtype: torch.dtype, device: torch.device | str):
        self.step, self.max_rank, self.slice_sizes = step, max_rank, slice_sizes
        width = max_rank * len(slice_sizes)
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, sum(slice_sizes), width, dtype=dtype, device=device)

    def write(self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's (A, B) per slice index into `slot` (untargeted slices stay zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, (a, b) in slices.items():
            col, row = index * self.max_rank, sum(self.slice_sizes[:index])
            self.a[slot, col:col + a.shape[0]] = a
            self.b[slot, row:row + b.shape[0], col:col + b.shape[1]] = b

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y with each group's rows plus their adapter's delta (y is the base Linear's fresh output)."""
        for slot, rows in self.step.groups:
            part = x.index_select(0, rows)
            y.index_add_(0, rows, (part @ self.a[slot].T) @ self.b[slot].T)
        return y
