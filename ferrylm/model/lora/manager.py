"""The runner's LoRA state: slots attached to the decoder's Linears, adapters read from their files
(kept unpacked in host memory up to --max-cpu-loras, LRU), and per step the adapters of the
scheduled rows placed in slots and their rows grouped, so each Linear adds its deltas."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ferrylm.config import LoRAConfig, ModelConfig
from ferrylm.executor import LoRAError
from ferrylm.model.lora.adapter import MODULE_SLICES, LoRAAdapter, load_adapter
from ferrylm.model.lora.slots import LoRASlots, StepGroups, StepHolder
from ferrylm.model.parallel.tp import TPShard, shard_index
from ferrylm.scheduler_output import SchedulerOutput

_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAManager:
    """`model_config`: the whole model's (adapters are checked against it); under tensor parallelism
    `local_config` is this rank's and `shard` its TPShard: each rank keeps the slice of B a
    column-parallel layer (q/k/v, gate/up) holds rows of, and of A a row-parallel one (o, down)
    holds columns of, so the all-reduce after o and down sums the ranks' partial deltas."""

    def __init__(self, model: nn.Module, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str, local_config: ModelConfig | None = None, shard: TPShard | None = None):
        self.config, self.model_config, self.dtype, self.shard = config, model_config, dtype, shard
        self.step = StepHolder()
        self.slots = _attach(model, self.step, config, local_config or model_config, dtype, device)
        self._paths: dict[str, str] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU, at most config.cpu_capacity
        self._resident: OrderedDict[str, int] = OrderedDict()  # name → slot, LRU
        self._adapter_of: dict[str, str] = {}  # request id → adapter name

    def add(self, name: str, path: str) -> int:
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype)
        self.remove(name)
        self._paths[name] = path
        self._keep(adapter)
        return adapter.rank

    def remove(self, name: str) -> None:
        self._paths.pop(name, None)
        self._host.pop(name, None)
        self._resident.pop(name, None)

    def track(self, step: SchedulerOutput) -> None:
        """Remember which adapter each new request runs through; forget finished requests."""
        for rid in step.finished_ids:
            self._adapter_of.pop(rid, None)
        for new in step.new_requests:
            if new.lora_name is not None:
                if new.lora_name not in self._paths:
                    raise LoRAError(f"request {new.request_id}: LoRA adapter {new.lora_name!r} is not loaded")
                self._adapter_of[new.request_id] = new.lora_name

    @contextmanager
    def rows(self, request_ids: list[str], query_lens: list[int], device: torch.device) -> Iterator[None]:
        """While inside, the model's Linears add each request's adapter delta to its rows (sequence i
        holds query_lens[i] consecutive rows of the flat batch)."""
        rows: dict[int, list[int]] = {}
        start = 0
        for rid, n in zip(request_ids, query_lens):
            name = self._adapter_of.get(rid)
            if name is not None:
                rows.setdefault(self._slot(name), []).extend(range(start, start + n))
            start += n
        self.step.groups = StepGroups.build(rows, self.config.max_loras, self.dtype, device)
        try:
            yield
        finally:
            self.step.groups = StepGroups()

    def _slot(self, name: str) -> int:
        """The adapter's slot, writing it into the least recently used one when it is not resident
        (the scheduler keeps at most max_loras adapters running, so a step's fit)."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return self._resident[name]
        used = set(self._resident.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        slot = free[0] if free else self._resident.popitem(last=False)[1]
        self._write(slot, self._adapter(name))
        self._resident[name] = slot
        return slot

    def _adapter(self, name: str) -> LoRAAdapter:
        if name in self._host:
            self._host.move_to_end(name)
            return self._host[name]
        adapter = load_adapter(name, self._paths[name], self.model_config, self.config.max_lora_rank, self.dtype)
        self._keep(adapter)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        per_linear: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            fused, index = MODULE_SLICES[module]
            if self.shard is not None:
                rows, cols = shard_index(f"{module}.weight", self.model_config, self.shard)
                a, b = (a if cols is None else a[:, cols]), (b if rows is None else b[rows])
            per_linear.setdefault((layer, fused), {})[index] = (a, b)
        for key, slots in self.slots.items():
            slots.write(slot, per_linear.get(key, {}))


def _attach(model: nn.Module, step: StepHolder, config: LoRAConfig, mc: ModelConfig, dtype: torch.dtype,
            device: torch.device | str) -> dict[tuple[int, str], LoRASlots]:
    """LoRASlots on every dense decoder Linear an adapter may target (MoE MLPs get none)."""
    q, kv, inter = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim, mc.intermediate_size
    sizes = {"qkv_proj": [q, kv, kv], "o_proj": [mc.hidden_size], "gate_up_proj": [inter, inter],
             "down_proj": [mc.hidden_size]}
    attached = {}
    for index, layer in enumerate(model.layers):  # type: ignore[arg-type]
        for fused in _FUSED:
            owner = layer.self_attn if fused in ("qkv_proj", "o_proj") else layer.mlp
            linear = getattr(owner, fused, None)
            if linear is None:
                continue
            linear.lora = LoRASlots(step, config.max_loras, config.max_lora_rank, linear.in_features,
                                    sizes[fused], dtype, device)
            attached[(index, fused)] = linear.lora
    return attached
