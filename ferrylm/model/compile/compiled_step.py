"""Compiled decode steps on CPU: the torch.compile (inductor) analogue of cuda_graphs.py.

At batch 1 a CPU decode step of a small model is mostly per-op overhead: ~15 Python-dispatched
ops per layer x 30 layers. The whole decode step (embedding, every layer, final norm, LM head) is
compiled into one inductor graph: elementwise work fused into generated C++, the matmuls and the
C++ attention / norm / RoPE ops (torch ops, cpu_kernels.py) called from it without Python.

A graph's batch dimension is symbolic, so a few graphs cover 1..max_num_seqs rows: one for a
single row (its GEMMs are GEMVs) and one for 2..max_num_seqs, split further only where the model
branches on the batch size (a quantized Linear picking a kernel by row count): each graph's own
shape guards say which sizes it serves. Unlike CUDA graphs nothing is padded, so every row runs the
GEMMs eager mode runs and the tokens are the same bit for bit. The step's tensors are copied into
static buffers whose block-table width is fixed (max_model_len).

Compilation happens in `warm_up` (start-up), never in a request's path: each graph is compiled
ahead of time (`torch.compile(...).aot_compile`) and saved under the cache directory, keyed by
everything it depends on (compile_cache.py); a restart loads it without re-tracing the model.
Prefill, mixed and oversize batches run eagerly. A model that does not trace as one graph (an op
that is not a torch op) is not compiled at all: a graph split per layer is slower than eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol, cast

import torch

from ferrylm.model.arch.llama import KVCache, LlamaForCausalLM
from ferrylm.model.compile.compile_cache import compile_cache_dir, inductor_cache_dir, load_step, save_step, step_key
from ferrylm.model.compile.cuda_graphs import StaticDecodeInputs
from ferrylm.model.forward_batch import ForwardBatch

log = logging.getLogger("ferrylm.compile")

# Inductor options of every compiled step. emulate_precision_casts: round to bf16 where eager
# rounds (silu(gate) before * up, ...), so compiled tokens equal eager tokens bit for bit. No size
# or alignment asserts after every op call: ~500 Python calls a step (~0.5 ms at batch 1).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "size_asserts": False, "alignment_asserts": False}
MAX_GRAPHS = 6  # sizes a model splits into more ranges than this run eagerly
# Graphs serving at most this many rows get inductor's C++ wrapper: their kernels are called from
# generated C++, not Python. At batch 1 the Python wrapper's ~600 calls were ~1.2 ms of a 14 ms step
# (decode 75.6 -> 82 tok/s measured, bench/RESULTS.md); the cost is compile time (83 s instead of 39 s
# for SmolLM2, once: cached). Larger batches spend 60+ ms a step in the kernels and keep Python's.
CPP_WRAPPER_MAX_ROWS = 8  # the graph of 2..8 rows (decode rows verifying drafts, small batches)


def inductor_options(high: int) -> dict:
    """Inductor options of the graph compiled for batches of up to `high` rows."""
    return {**INDUCTOR_OPTIONS, "cpp_wrapper": True} if high <= CPP_WRAPPER_MAX_ROWS else dict(INDUCTOR_OPTIONS)


class TensorDecodeBackend(Protocol):
    """An attention backend that builds a decode-only batch's metadata from its tensors alone (no host-side
    length lists): what a compiled step needs (attention/cpu.py's CpuBackend)."""

    def prepare_decode(self, batch: ForwardBatch) -> object: ...


def decode_logits(model: LlamaForCausalLM, kv_caches: list[KVCache], input_ids: torch.Tensor,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, vocab] of a decode-only batch of B rows: the function that is compiled.

    B may be symbolic, so nothing here builds a Python list of B items: the host-side length lists
    stay empty and the backend's prepare_decode() derives its metadata from the tensors alone."""
    num_rows = input_ids.shape[0]
    rows = torch.arange(num_rows, device=input_ids.device)
    batch = ForwardBatch(input_ids, positions, slot_mapping, block_tables, seq_lens,
                         query_start_loc=torch.arange(num_rows + 1, device=input_ids.device), logits_indices=rows,
                         seq_lens_list=[], query_lens_list=[])
    batch = batch.with_attn_metadata(cast(TensorDecodeBackend, model.attn_backend).prepare_decode(batch))
    return model.compute_logits(model(batch, kv_caches))


class SizeRange(NamedTuple):
    low: int
    high: int
    step: Callable[..., torch.Tensor]  # serves batches of low..high rows

    @property
    def name(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


class WarmUpReport(NamedTuple):
    seconds: float
    loaded: list[str]  # graphs read from the cache, by the sizes they serve ("2-64")
    compiled: list[str]  # graphs compiled (and saved) now


class GraphNotCached(LookupError):
    """warm_up(compile_missing=False) met a batch-size bucket whose graph is not in the disk cache."""


class CompiledDecodeStep:
    """Decode-only batches of up to max_num_seqs rows through compiled graphs.

    `warm_up()` must run first; afterwards `can_run(batch)` says whether `logits(batch)` applies.
    The attention backend must build a decode-only batch's metadata from tensors (prepare_decode).
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_num_seqs: int, max_blocks: int,
                 pad_block: int, block_size: int, cache_dir: Path | None = None):
        if not hasattr(model.attn_backend, "prepare_decode"):
            raise ValueError(f"{type(model.attn_backend).__name__} cannot run a compiled decode step")
        self.model, self.kv_caches = model, kv_caches
        self.max_num_seqs = max_num_seqs
        self.inputs = StaticDecodeInputs(max_num_seqs, max_blocks, pad_block, block_size, kv_caches[0][0].device)
        self.cache_dir = cache_dir or compile_cache_dir()
        self.ranges: list[SizeRange] = []
        self.report: WarmUpReport | None = None  # what the last warm_up() did
        self._calls: dict[int, Callable[[], torch.Tensor]] = {}  # per batch size: the graph on its flat inputs

    def _step_for(self, num_rows: int) -> Callable[..., torch.Tensor] | None:
        return next((r.step for r in self.ranges if r.low <= num_rows <= r.high), None)

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.inputs.fits(batch) and self._step_for(batch.num_seqs) is not None

    def _args(self, num_rows: int) -> tuple:
        view = self.inputs.view(num_rows)
        return (self.model, self.kv_caches, view.input_ids, view.positions, view.slot_mapping, view.block_tables,
                view.seq_lens)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [num_seqs, vocab], one row per sequence of the decode-only `batch`."""
        step = self._step_for(batch.num_seqs)
        if step is None or not self.inputs.fits(batch):
            raise ValueError(f"no compiled step for a batch of {batch.num_seqs} rows")
        self.inputs.fill(batch, batch.num_seqs)
        call = self._calls.get(batch.num_seqs)
        if call is not None:
            return call()
        logits, self._calls[batch.num_seqs] = flat_call(step, self._args(batch.num_seqs))
        return logits

    @torch.inference_mode()
    def warm_up(self, compile_missing: bool = True) -> WarmUpReport:
        """Load or compile graphs from the largest batch down until every size has one (or
        MAX_GRAPHS are made); each runs once on padding rows (length 1, the pad slot). Raises when
        the model does not trace as one graph, and GraphNotCached (nothing published) on a graph
        missing from the cache unless `compile_missing`."""
        loaded: list[str]
        compiled: list[str]
        ranges: list[SizeRange]
        start, loaded, compiled, ranges = time.perf_counter(), [], [], []
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        high = self.max_num_seqs
        with inductor_cache_dir(self.cache_dir / "inductor"):
            while high >= 1 and len(ranges) < MAX_GRAPHS:
                options = inductor_options(high)
                key = step_key(self.model, self.kv_caches, self._args(high)[2:],
                               {**options, "high": high, "max": self.max_num_seqs})
                path = self.cache_dir / f"decode-{key}.bin"
                step = load_step(path, self._args(high), globals())
                done = loaded if step is not None else compiled
                if step is None and not compile_missing:
                    raise GraphNotCached(path.name)
                if step is None:
                    log.info("compiling the decode step for up to %d rows (once: cached in %s)", high, self.cache_dir)
                    step = _compile(self._args(high), path, options)
                ranges.append(SizeRange(self._lowest_accepted(step, high), high, step))
                done.append(ranges[-1].name)
                step(*self._args(high))
                high = ranges[-1].low - 1
        self.ranges = ranges
        self._calls = {}
        self.report = WarmUpReport(time.perf_counter() - start, loaded, compiled)
        return self.report

    def _lowest_accepted(self, step, high: int) -> int:
        """The smallest size from which the step's guards accept every size up to `high`."""
        low = high
        while low > 1 and step.guard_check(*self._args(low - 1)):
            low -= 1
        step.disable_guard_check()  # checked here, per size; evaluating guards each step costs ~1 ms
        return low


def flat_call(step, args: tuple) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Run `step` (an AOTCompiledFunction) on `args` and return its logits with a call that repeats it
    on the same inputs without dynamo's bytecode. That bytecode gathers the graph's ~270 flat inputs
    (every parameter, by module attribute lookups) on each call: ~0.3 ms of a 1-row step's ~8 ms on the
    MoE GGUF bench model. Here they are gathered once, from the call the bytecode makes, and kept: `args`
    are views of the static input buffers (refilled in place before each call) and parameters, which
    nothing replaces after loading. Where the bytecode does anything but return the graph's one output
    (another torch version), the call returned is `step` on `args` itself."""
    plain = lambda: step(*args)  # noqa: E731
    fn, backend_id = getattr(step, "fn", None), getattr(getattr(step, "_artifacts", None), "backend_id", None)
    if fn is None or backend_id not in getattr(fn, "__globals__", {}):
        return plain(), plain
    graph = fn.__globals__[backend_id]
    seen: list[tuple[tuple, object]] = []

    def record(*flat):
        out = graph(*flat)
        seen.append((flat, out))
        return out

    fn.__globals__[backend_id] = record
    try:
        logits = step(*args)
    finally:
        fn.__globals__[backend_id] = graph
    if len(seen) != 1 or not isinstance(seen[0][1], (list, tuple)) or len(seen[0][1]) != 1 \
            or seen[0][1][0] is not logits:
        return logits, plain
    flat = seen[0][0]
    return logits, lambda: graph(*flat)[0]


def _compile(args: tuple, path: Path, options: dict):
    """Trace and compile decode_logits with the batch dim symbolic (its size, args', the hint inductor
    tunes for); save the result to `path`. Guards narrow the sizes it serves where the model
    branches on the batch size. Marks the input views it is given."""
    if args[2].shape[0] > 1:
        for t in args[2:]:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    fn = torch.compile(decode_logits, fullgraph=True, dynamic=None,
                       options={**options, "guard_filter_fn": _guard_filter})
    # Dynamo remembers every earlier compile of decode_logits in this process (another model's, a
    # test's) and would turn whatever differed into symbols, floats included, which aot_compile cannot
    # restart from (TensorifyScalarRestartAnalysis): each step is traced as if it were the first.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        step = fn.aot_compile((args, {}))  # type: ignore[attr-defined]  # stub lacks aot_compile
    save_step(step, path)
    return step


def _guard_filter(entries: list) -> list[bool]:
    """Keep dynamo's guards on grad mode, symbolic sizes and the shapes of the KV caches, buffers
    and inputs; drop those on every parameter and module attribute. step_key already pins the module
    tree and every tensor's shape, and thousands of guards take ~1 s to rebuild when loading."""
    return [e.guard_type in ("GLOBAL_STATE", "SHAPE_ENV") or (
        e.guard_type == "TENSOR_MATCH" and not e.is_global and not isinstance(e.value, torch.nn.Parameter))
        for e in entries]
