"""Tensor parallelism on torch.distributed (gloo on CPU; the same calls run over NCCL on CUDA).

Megatron's layout: QKV and gate/up are column-parallel (each rank holds some heads and some
intermediate columns), o_proj and down are row-parallel (each rank multiplies its slice of the
inputs, then an all-reduce sums the partial outputs), the embedding and the LM head are split by
vocabulary (a lookup is masked to the rank's ids then all-reduced; logits are all-gathered).
KV heads are split across ranks with their query heads; with more ranks than KV heads each KV head
is replicated on world / num_kv_heads ranks, which split its query heads (as vLLM does). Splits
need not be even (SmolLM2's 9 query heads in 3 KV groups over 2 ranks: 6 and 3).

The group is a ProcessGroupGloo over a TCPStore owned by the engine, not torch.distributed's
process-wide default group, so an engine can be built and torn down more than once in a process.
"""

from __future__ import annotations

import datetime
import pickle
import re
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from ferrylm.config import ConfigError, ModelConfig
from ferrylm.model.loaders.int4_checkpoint import Int4Tensor
from ferrylm.model.loaders.model_source import ModelLoadError

TIMEOUT = datetime.timedelta(seconds=120)  # a collective a peer never joins (a dead rank) fails after this


def _split(n: int, parts: int, index: int) -> range:
    """The index-th of `parts` near-equal consecutive ranges of range(n) (the first ones larger)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True)
class TPShard:
    """What rank `rank` of `world` holds, as ranges of global indices."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range
    intermediate: range
    expert_intermediate: range  # each expert's columns this rank keeps (MoE: experts split like the MLP)
    shared_intermediate: range  # the shared expert's columns (Llama 4), split like the MLP
    vocab: range
    experts: range | None = None  # expert parallelism: the experts this rank holds whole; None: all


def shard_plan(config: ModelConfig, rank: int, world: int, expert_parallel: bool = False) -> TPShard:
    """Heads, intermediate columns and vocabulary rows of one rank; with `expert_parallel`, whole
    experts (a contiguous share of them) instead of every expert's columns. A ConfigError when the
    model cannot be split that many ways."""
    heads, kv = config.num_heads, config.num_kv_heads
    group = heads // kv
    if world <= kv:
        kv_heads = _split(kv, world, rank)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:
        if world % kv:
            raise ConfigError(f"--tensor-parallel-size {world} must divide or be a multiple of the model's {kv} "
                              "KV heads")
        reps = world // kv
        if reps > group:
            raise ConfigError(f"--tensor-parallel-size {world} leaves a rank without query heads "
                              f"({heads} query heads, {kv} KV heads)")
        kv_head = rank // reps
        kv_heads = range(kv_head, kv_head + 1)
        own = _split(group, reps, rank % reps)
        q_heads = range(kv_head * group + own.start, kv_head * group + own.stop)
    if world > config.intermediate_size or world > config.vocab_size or \
            (config.num_experts and world > config.moe_intermediate_size):
        raise ConfigError(f"--tensor-parallel-size {world} is larger than the model's layers can be split")
    experts, expert_columns = None, _split(config.moe_intermediate_size, world, rank)
    if expert_parallel:  # whole experts per rank: every column of the ones it holds
        if not config.num_experts:
            raise ConfigError("--enable-expert-parallel needs a mixture-of-experts model")
        if world > config.num_experts:
            raise ConfigError(f"--enable-expert-parallel: {world} ranks for {config.num_experts} experts")
        experts, expert_columns = _split(config.num_experts, world, rank), range(config.moe_intermediate_size)
    return TPShard(rank, world, q_heads, kv_heads, _split(config.intermediate_size, world, rank), expert_columns,
                   _split(config.shared_expert_intermediate_size, world, rank), _split(config.vocab_size, world, rank),
                   experts)


def local_config(config: ModelConfig, shard: TPShard) -> ModelConfig:
    """The shapes of one rank's model: its heads, intermediate columns and vocabulary rows."""
    return replace(config, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads),
                   intermediate_size=len(shard.intermediate), vocab_size=len(shard.vocab),
                   moe_intermediate_size=len(shard.expert_intermediate),
                   shared_expert_intermediate_size=len(shard.shared_intermediate),
                   local_experts=None if shard.experts is None else tuple(shard.experts))


def holds(name: str, shard: TPShard) -> bool:
    """Whether this rank loads checkpoint tensor `name` at all: under expert parallelism only its
    own experts' weights."""
    m = re.search(r"\.experts\.(\d+)\.", name)
    return shard.experts is None or m is None or int(m.group(1)) in shard.experts


def shard_index(name: str, config: ModelConfig, shard: TPShard) -> tuple[slice | None, slice | None]:
    """(rows, columns) of the checkpoint tensor `name` (HF names) that this rank keeps; None: all."""
    d = config.head_dim
    q = slice(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv = slice(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    own = shard.expert_intermediate if ".experts." in name else \
        shard.shared_intermediate if ".shared_expert." in name else shard.intermediate
    inter = slice(own.start, own.stop)
    vocab = slice(shard.vocab.start, shard.vocab.stop)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter,
            "embed_tokens": vocab, "lm_head": vocab}
    cols = {"o_proj": q, "down_proj": inter}
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in rows:
        return rows[module], None
    if module in cols and parts[-1] == "weight":
        return None, cols[module]
    return None, None  # norms (and an o_proj / down bias, which no supported architecture has)


def slice_int4(tensor: Int4Tensor, rows: slice | None, cols: slice | None, name: str, world: int) -> Int4Tensor:
    """One rank's part of a pre-quantized int4 weight, its codes still the file's. Rows (outputs) cut
    anywhere; columns (inputs of a row-parallel o_proj / down) only at group boundaries, and not
    under act-order, whose groups gather inputs from the whole row (a slice would hold part of
    every group): those are ModelLoadErrors naming the field."""
    if rows is not None:
        tensor = replace(tensor, codes=tensor.codes[rows].contiguous(), scales=tensor.scales[rows].contiguous(),
                         mins=tensor.mins[rows].contiguous())
    if cols is None:
        return tensor
    if tensor.perm is not None:
        raise ModelLoadError(f"{name}: an act-order (desc_act / actorder) int4 checkpoint cannot be split over "
                             f"--tensor-parallel-size {world}: its groups span the whole input; run with "
                             "--tensor-parallel-size 1 or use a checkpoint quantized without act-order")
    g = tensor.group
    if cols.start % g or cols.stop % g:
        raise ModelLoadError(f"{name}: --tensor-parallel-size {world} splits its {tensor.shape[1]} inputs at "
                             f"{cols.start}..{cols.stop}, not at multiples of the checkpoint's group_size {g}")
    groups = slice(cols.start // g, cols.stop // g)
    return replace(tensor, codes=tensor.codes[:, cols].contiguous(), scales=tensor.scales[:, groups].contiguous(),
                   mins=tensor.mins[:, groups].contiguous())


class ShardedCheckpoint:
    """Quacks like loader.Checkpoint for one rank: the local config and its slices of every weight, as
    float tensors. Safetensors are read a slice at a time (only the rank's bytes); GGUF row slices are
    cut from the blocks before dequantizing, column slices (o_proj, down) after. The rank then holds
    float weights (or re-quantizes them with --quantization int8 / int4): GGUF blocks are not kept
    packed under TP. An AWQ / GPTQ / compressed-tensors checkpoint is unpacked whole, then each int4
    weight is sliced with its codes kept (slice_int4)."""

    def __init__(self, checkpoint: Any, shard: TPShard):
        self.full_config: ModelConfig = checkpoint.config
        self.config = local_config(checkpoint.config, shard)
        self.shard, self._checkpoint = shard, checkpoint
        self.source = SimpleNamespace(kind="hf", path=f"{checkpoint.source.path} (tensor-parallel rank "
                                                     f"{shard.rank} of {shard.world})")

    def weights(self):
        source = self._checkpoint.source
        # what the loader must reshape first is read whole, then sliced: fused projections (Phi-3),
        # Llama 4's fused experts and interleaved q/k rows, an int4 checkpoint's packing (int4_checkpoint.py)
        if getattr(source, "kind", None) == "hf" and self.full_config.architecture not in ("phi3", "llama4") and \
                not self.full_config.prequantized:
            yield from self._safetensors_slices(source.path)
            return
        for name, tensor in self._checkpoint.weights():
            if not holds(name, self.shard):
                continue
            rows, cols = shard_index(name, self.full_config, self.shard)
            if isinstance(tensor, Int4Tensor):  # the file's codes, kept: slices of whole groups
                yield name, slice_int4(tensor, rows, cols, name, self.shard.world)
                continue
            if not isinstance(tensor, torch.Tensor):  # GGUF blocks: rows are independent byte rows
                if rows is not None:
                    data = tensor.data[rows]
                    tensor = replace(tensor, data=data, shape=(data.shape[0], tensor.shape[1]))
                tensor = tensor.to_float()
                rows = None
            t = tensor.float()
            t = t[rows] if rows is not None else t
            yield name, (t[:, cols] if cols is not None else t).contiguous()

    def _safetensors_slices(self, directory: Any):
        from safetensors import safe_open

        from ferrylm.model.loaders.hf_loader import _shard_files, canonical_name

        for path in _shard_files(directory):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = canonical_name(key)
                    if not holds(name, self.shard):
                        continue
                    rows, cols = shard_index(name, self.full_config, self.shard)
                    part = f.get_slice(key)
                    t = part[rows] if rows is not None else part[:, cols] if cols is not None else part[:]
                    yield name, t.float().contiguous()


class _GlooCollectives(Protocol):
    """The collectives TPGroup calls on its ProcessGroupGloo (torch's stub of the class leaves them out)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor]) -> dist.Work: ...

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...


class TPGroup:
    """One rank's side of the group: the collectives the model calls, and the per-step broadcast of
    the scheduler's decision (rank 0 sends; the others run the same forward)."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout: datetime.timedelta = TIMEOUT,
                 agent_store: bool = False):
        """`agent_store`: a launcher (torchrun) hosts the store at host:port; rank 0 joins it as a
        client too, and our keys live under a prefix of their own."""
        self.rank, self.world = rank, world
        self.peers_dead: Any = None  # rank 0: a callable naming a rank that exited (tp_worker.SpawnedRanks.dead)
        self.collective_seconds = 0.0  # time inside all-reduce / all-gather, for bench/tensor_parallel.py
        store = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store, timeout=timeout)
        self.store = dist.PrefixStore("ferrylm-tp/", store) if agent_store else store
        self.pg = cast(_GlooCollectives, dist.ProcessGroupGloo(self.store, rank, world, timeout))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (gloo reduces float32; other dtypes go through a float32 copy)."""
        start = time.perf_counter()
        if x.dtype == torch.float32 and x.is_contiguous():
            self.pg.allreduce([x]).wait()
        else:
            buf = x.float().contiguous()
            self.pg.allreduce([buf]).wait()
            x.copy_(buf)
        self.collective_seconds += time.perf_counter() - start
        return x

    def all_gather_columns(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[N, sizes[rank]] on each rank → [N, sum(sizes)], ranks' columns in order (padded to the
        largest size for the collective)."""
        start = time.perf_counter()
        width = max(sizes)
        local = torch.zeros(x.shape[0], width, dtype=torch.float32)
        local[:, :x.shape[1]] = x
        outs = [torch.empty_like(local) for _ in range(self.world)]
        self.pg.allgather([outs], [local]).wait()
        out = torch.cat([o[:, :n] for o, n in zip(outs, sizes)], dim=1).to(x.dtype)
        self.collective_seconds += time.perf_counter() - start
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; a size, then the bytes). Rank 0 first checks that its
        spawned ranks still run: a dead one is a clear error now, not a collective that times out."""
        if self.rank == 0 and self.peers_dead is not None:
            dead = self.peers_dead()
            if dead:
                raise RuntimeError(f"{dead}; the engine cannot continue without it")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(data, 0).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())


@dataclass
class TPContext:
    """What a rank's model needs: the group, its shard, and every rank's vocabulary slice sizes."""

    group: TPGroup
    shard: TPShard
    vocab_sizes: list[int]

    @classmethod
    def build(cls, group: TPGroup, config: ModelConfig, expert_parallel: bool = False) -> "TPContext":
        return cls(group, shard_plan(config, group.rank, group.world, expert_parallel),
                   [len(shard_plan(config, r, group.world).vocab) for r in range(group.world)])

    def embed(self, embed_local, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: this rank's rows for its ids, zeros elsewhere, summed over ranks."""
        local = input_ids - self.shard.vocab.start
        outside = (local < 0) | (local >= len(self.shard.vocab))
        x = embed_local(local.masked_fill(outside, 0))
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_columns(local_logits, self.vocab_sizes)
