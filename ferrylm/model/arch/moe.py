"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks the top-k experts of each
token; tokens are grouped by expert and each active expert runs once over its group (one GEMM
pair per expert, no per-token loop), its output scaled by the routing weight and summed back.

Each expert is a LlamaMLP-shaped pair of Linears, so checkpoint names (`experts.E.gate_proj` ...)
load through the same packing and QuantMethod as the dense MLP (--quantization int8/int4 packs
the experts too). Under tensor parallelism every rank holds every expert's slice of columns (the
router is replicated, so all ranks route alike) and the partial sums are all-reduced, as vLLM
does without expert parallelism; with it (--enable-expert-parallel) each rank holds whole experts,
a contiguous share, runs only those, and the all-reduce sums every rank's contribution. Every rank
sees every token (its activations are replicated after each all-reduce), so no all-to-all is needed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.model.arch.layers import GatedMLP, Linear
from ferrylm.model.quant.base import QuantMethod, UnquantizedMethod


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
        # expert parallelism: the experts of other ranks are placeholders this rank never runs
        self.local = set(range(config.num_experts) if config.local_experts is None else config.local_experts)
        self.experts = nn.ModuleList(GatedMLP(config.hidden_size, config.moe_intermediate_size, quant)
                                     if e in self.local else nn.Identity() for e in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sigmoid_router:  # Llama 4: top-k logits, their sigmoid scales the expert's input
            logits, chosen = self.gate(x).topk(self.top_k, dim=-1)
            weights = torch.sigmoid(logits.float()).to(x.dtype)
        else:
            probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E], float32 like the reference
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
