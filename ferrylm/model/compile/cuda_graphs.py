"""CUDA graphs for decode steps: one captured model forward per batch-size bucket.

A decode step of a small model is mostly kernel-launch overhead (30 layers x ~10 launches), which
a graph replays in one call. Graphs read fixed addresses, so each step's ForwardBatch is copied into
static buffers sized for the largest bucket and padded up to the bucket: padding rows have length 1,
write their K/V into a reserved pad block that the block manager never hands out, and their
outputs are dropped. Prefill, mixed and oversize batches run eagerly.

The attention backend must launch decode kernels from shapes only (never from host-side lengths):
each bucket's attention metadata is prepared once, from the static padded inputs and before
capture, and every replay reuses it. Backends whose `prepare` of a decode-only batch depends on
shapes only declare `supports_cuda_graphs = True` (TritonBackend).
"""

from __future__ import annotations

from typing import NamedTuple, TypedDict

import torch

from ferrylm.model.arch.llama import KVCache, LlamaForCausalLM
from ferrylm.model.forward_batch import ForwardBatch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def pick_bucket(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs rows (sizes ascending); None when too many."""
    return next((s for s in sizes if s >= num_seqs), None)


class _TensorOptions(TypedDict):
    """The dtype= and device= keywords of a torch factory call."""

    dtype: torch.dtype
    device: torch.device | str


class StaticDecodeInputs:
    """Fixed-address decode inputs for max_num_seqs rows; `fill` copies a batch in and pads it."""

    def __init__(self, max_num_seqs: int, max_blocks: int, pad_block: int, block_size: int,
                 device: torch.device | str):
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        i64: _TensorOptions = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_num_seqs, **i64)
        self.positions = torch.zeros(max_num_seqs, **i64)
        self.slot_mapping = torch.full((max_num_seqs,), self.pad_slot, **i64)
        self.block_tables = torch.full((max_num_seqs, max_blocks), pad_block, **i64)
        self.seq_lens = torch.ones(max_num_seqs, **i64)
        self.query_start_loc = torch.arange(max_num_seqs + 1, **i64)  # one token per row, fixed
        self.logits_indices = torch.arange(max_num_seqs, **i64)

    def fits(self, batch: ForwardBatch) -> bool:
        """A decode-only batch with no more rows or blocks than the buffers hold."""
        return (batch.is_decode_only and 0 < batch.num_seqs <= self.max_num_seqs
                and batch.block_tables.shape[1] <= self.max_blocks)

    def view(self, size: int) -> ForwardBatch:
        """The batch a graph of `size` rows is captured with (it keeps these tensors' addresses)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            logits_indices=self.logits_indices[:size], seq_lens_list=[1] * size, query_lens_list=[1] * size)

    def fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy batch's n rows in, make rows n..size padding. Block-table entries past a row's
        length may be stale: kernels read only the blocks that hold its first seq_len tokens."""
        if not self.fits(batch) or size < batch.num_seqs:
            raise ValueError(f"a batch of {batch.num_seqs} rows does not fit bucket {size}")
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.pad_block)


class CapturedGraph(NamedTuple):
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # hidden states [size, hidden], overwritten by each replay
    inputs: ForwardBatch  # the static view it was captured with; keeps its attention metadata alive


class CudaGraphRunner:
    """Captures `model` for each bucket size, then serves decode batches by replay.

    `forward(batch)` replays when the batch is decode-only and fits, else runs eagerly; both return
    hidden states [num_seqs, hidden]. A replayed result is a view of the graph's output buffer, valid
    until the next replay (the runner turns it into logits at once).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_num_seqs: int, max_blocks: int,
                 pad_block: int, block_size: int):
        backend = model.attn_backend
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"{type(backend).__name__} launches decode kernels from host-side lengths; "
                             "CUDA graphs need a backend with supports_cuda_graphs (TritonBackend)")
        self.model, self.kv_caches = model, kv_caches
        self.device = kv_caches[0][0].device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.inputs = StaticDecodeInputs(max_num_seqs, max_blocks, pad_block, block_size, self.device)
        self.backend = backend
        self.graphs: dict[int, CapturedGraph] = {}

    def can_replay(self, batch: ForwardBatch) -> bool:
        return bool(self.graphs) and self.inputs.fits(batch)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the kernels) and capture every bucket, largest first, in one memory pool.
        Each bucket's attention metadata is prepared before its capture, outside the graph."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need the model and KV cache on a CUDA device")
        pool = None
        for size in reversed(self.sizes):
            view = self.inputs.view(size)
            view = view.with_attn_metadata(self.backend.prepare(view))
            self.model(view, self.kv_caches)  # all rows are padding here: lengths 1, pad slot
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(view, self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = CapturedGraph(graph, out, view)
        torch.cuda.synchronize(self.device)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        size = pick_bucket(self.sizes, batch.num_seqs)
        if size is None or not self.can_replay(batch):
            raise ValueError(f"no captured graph for a batch of {batch.num_seqs} rows")
        self.inputs.fill(batch, size)
        captured = self.graphs[size]
        captured.graph.replay()
        return captured.output[:batch.num_seqs]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states for `batch`: graph replay when possible (its own metadata, if any, is not
        needed), eager otherwise."""
        if self.can_replay(batch):
            return self.replay(batch)
        return self.model(batch, self.kv_caches)
