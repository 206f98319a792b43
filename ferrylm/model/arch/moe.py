"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks the top-k experts of each
token; tokens are grouped by expert and each active expert runs once over its group (one GEMM
pair per expert, no per-token loop), its output scaled by the routing weight and summed back.

Each expert is a LlamaMLP-shaped pair of Linears, so checkpoint names (`experts.E.gate_proj` ...)
load through the same packing and QuantMethod as the dense MLP (--quantization int8/int4 packs
the experts too). Under tensor parallelism every rank holds every expert's slice of columns (the
router is replicated, so all ranks route alike) and the partial sums are all-reduced, as vLLM
does without expert parallelism; with it (--enable-expert-parallel) each rank holds whole experts,
a contiguous share, runs only those, and the all-reduce sums every rank's contribution. Every rank
sees every token (its activations are replicated after each all-reduce), so no all-to-all is needed.

Where the experts are packed alike and int8 activations apply (decode rows; quant/packed.py's policy),
`stack_experts` lays a layer's experts end to end after loading and the routed experts run as one C++
op (quant/csrc/moe_experts.cpp): no per-expert Python, and a fixed output shape, so the decode step
compiles into one graph like a dense model's."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.model.arch.layers import GatedMLP, Linear, SiluAndMul
from ferrylm.model.quant.base import QuantMethod, UnquantizedMethod
from ferrylm.model.quant.packed import PackedWeight


class StackedExperts(nn.Module):
    """A layer's local experts' packed weights end to end, slot after slot (the experts' own
    PackedWeights become views into these): what the fused op reads. `slots[e]`: expert e's slot, -1
    where it lives on another rank."""

    def __init__(self, gate_up: list[PackedWeight], down: list[PackedWeight], slots: torch.Tensor):
        super().__init__()
        self.gate_up, self.down = _stack(gate_up), _stack(down)
        self.register_buffer("slots", slots)

    def int8_rows(self, dtype: torch.dtype) -> int:
        """Up to how many token rows the experts' own matmuls would take int8 activations (0: none)."""
        return min(self.gate_up.int8_rows(dtype), self.down.int8_rows(dtype))

    def forward(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, routing: int) -> torch.Tensor:
        gu, dn = self.gate_up, self.down
        return gu.kernels.moe_experts_int8(x, logits, top_k, routing, self.slots, gu.codes, gu.scales, gu.mins,
                                             gu.group, gu.q4, dn.codes, dn.scales, dn.mins, dn.group, dn.q4)


def _stack(weights: list[PackedWeight]) -> PackedWeight:
    """One PackedWeight of `weights`' rows in order; each of `weights` then views its share (no copy kept)."""
    first = weights[0]
    mins = None if first.mins is None else torch.cat([cast(torch.Tensor, w.mins) for w in weights])
    stacked = PackedWeight(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]), mins,
                           first.group, first.q4, first.kernels, first.buffer)
    rows = first.out_features
    for s, w in enumerate(weights):
        share = slice(s * rows, (s + 1) * rows)
        w.codes, w.scales = stacked.codes[share], stacked.scales[share]
        if mins is not None:
            w.mins = cast(torch.Tensor, stacked.mins)[share]
    return stacked


def _same_layout(weights: list[Any]) -> bool:
    """All PackedWeights of one shape, group, code width and scale/min form, with the fused op built."""
    if not weights or not all(isinstance(w, PackedWeight) for w in weights):
        return False
    first = weights[0]
    return first.kernels is not None and first.kernels.moe_experts_int8 is not None and all(
        (w.out_features, w.in_features, w.group, w.q4, w.scales.dtype, w.mins is None, w.codes.device.type) ==
        (first.out_features, first.in_features, first.group, first.q4, first.scales.dtype, first.mins is None, "cpu")
        for w in weights)


class SparseMoeBlock(nn.Module):
    """Router + experts. `config.norm_topk_prob`: renormalise the k chosen probabilities to sum to
    one (Mixtral always; Qwen3-MoE as its config says)."""

    def __init__(self, config: ModelConfig, quant: QuantMethod | None = None, tp: Any = None):
        super().__init__()
        self.tp = tp  # tensor parallel: each rank holds every expert's slice of columns; partial sums all-reduced
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.sigmoid_router = config.moe_router == "sigmoid"
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, quant) \
            if config.shared_expert_intermediate_size else None
        self.gate = Linear(config.hidden_size, config.num_experts, quant=UnquantizedMethod())  # the router
        self.register_buffer("router_f32", None, persistent=False)  # prepare_router()
        # expert parallelism: the experts of other ranks are placeholders this rank never runs
        self.local = set(range(config.num_experts) if config.local_experts is None else config.local_experts)
        self.experts = nn.ModuleList(GatedMLP(config.hidden_size, config.moe_intermediate_size, quant)
                                     if e in self.local else nn.Identity() for e in range(config.num_experts))
        self.stacked: StackedExperts | None = None  # set by stack_experts() where the fused op applies
        self.routing = 2 if self.sigmoid_router else 1 if self.norm_topk_prob else 0  # moe_experts.cpp's Routing

    def stack_experts(self) -> None:
        """After loading: stack the local experts' packed weights for the fused op, if they are all
        PackedWeights of one layout with SiLU, no bias and no LoRA (else the per-expert loop runs)."""
        local = sorted(self.local)
        mlps = [cast(GatedMLP, self.experts[e]) for e in local]
        linears = [lin for m in mlps for lin in (m.gate_up_proj, m.down_proj)]
        if not mlps or any(not isinstance(m.act, SiluAndMul) for m in mlps) or \
                any(lin.bias is not None or lin.lora is not None for lin in linears):
            return
        gate_up = [getattr(m.gate_up_proj, "packed", None) for m in mlps]
        down = [getattr(m.down_proj, "packed", None) for m in mlps]
        if not (_same_layout(gate_up) and _same_layout(down)):
            return
        slots = torch.full((len(self.experts),), -1, dtype=torch.int64)
        for s, e in enumerate(local):
            slots[e] = s
        self.stacked = StackedExperts(cast("list[PackedWeight]", gate_up), cast("list[PackedWeight]", down), slots)

    def prepare_router(self) -> None:
        """After loading: a float32 copy of a 16-bit router's weight on the CPU. Its tiny product ([T, H] x
        [H, E]) in float32 took ~6 us a call at one row, oneDNN's bf16 matmul ~21 us (its per-call set-up),
        once per MoE layer per step; the logits are rounded to x's dtype as the bf16 matmul rounds them."""
        weight = self.gate.weight
        if weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu" and self.gate.bias is None:
            self.router_f32 = weight.detach().float()

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_f32 is not None and self.gate.lora is None:
            return nn.functional.linear(x.float(), self.router_f32).to(x.dtype)
        return self.gate(x)

    def fused_for(self, dtype: torch.dtype) -> bool:
        """Whether a decode step in `dtype` runs the fused op whatever its size (compiled steps do)."""
        return self.stacked is not None and self.stacked.int8_rows(dtype) > 0

    def _fused(self, x: torch.Tensor) -> bool:
        if self.stacked is None or cast(GatedMLP, self.experts[min(self.local)]).gate_up_proj.lora is not None:
            return False
        rows = self.stacked.int8_rows(x.dtype)
        # a compiled step takes it at every size (the loop does not trace); eager where the loop's
        # experts would all take int8 activations anyway
        return rows > 0 and (torch.compiler.is_compiling() or x.shape[0] <= rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):
            routed = cast(StackedExperts, self.stacked)(x, self.router_logits(x), self.top_k, self.routing)
            out = routed if self.shared_expert is None else self.shared_expert(x) + routed
            return out if self.tp is None else self.tp.group.all_reduce(out)
        if self.sigmoid_router:  # Llama 4: top-k logits, their sigmoid scales the expert's input
            logits, chosen = self.router_logits(x).topk(self.top_k, dim=-1)
            weights = torch.sigmoid(logits.float()).to(x.dtype)
        else:
            probs = torch.softmax(self.router_logits(x).float(), dim=-1)  # [T, E], float32 like the reference
            weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(x.dtype)
        flat = chosen.flatten()  # [T*k]: token t's i-th choice at t*k + i
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k  # the token of each (token, choice) pair, grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        routed = weights.flatten()[order, None]
        out = self.shared_expert(x) if self.shared_expert is not None else torch.zeros_like(x)
        start = 0  # the loop below also advances past other ranks' experts
        for e, (expert, count) in enumerate(zip(self.experts, counts)):
            if count and e in self.local:
                rows, scale = tokens[start:start + count], routed[start:start + count]
                y = expert(x.index_select(0, rows) * scale) if self.sigmoid_router else \
                    expert(x.index_select(0, rows)) * scale
                out.index_add_(0, rows, y)
            start += count
        return out if self.tp is None else self.tp.group.all_reduce(out)
