"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3; with arch/moe.py Mixtral and
Qwen3-MoE; arch/gemma3.py builds Gemma 3 from its attention and MLP) over a paged KV cache.

Shapes: T = tokens in the flat batch, H = query heads, Hkv = KV heads, D = head dim.
Q/K/V and gate/up projections are packed into one matmul each.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.model.arch.layers import GatedMLP, GemmaRMSNorm, Linear, RMSNorm, RotaryEmbedding
from ferrylm.model.arch.moe import SparseMoeBlock
from ferrylm.model.attention.base import AttentionBackend
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.quant.base import QuantMethod, UnquantizedMethod

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """`qk_norm`: the class of the per-head q/k norms when config.qk_norm (Gemma passes its own).
    A layer in config.sliding_layers passes its window to the backend, which masks older keys."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantMethod | None = None, tp: Any = None, layer_index: int = 0,
                 qk_norm: type[RMSNorm] | type[GemmaRMSNorm] = RMSNorm):
        super().__init__()
        self.tp = tp  # parallel.TPContext: o_proj is row-parallel, its partial sums all-reduced
        self.use_rope = layer_index not in config.nope_layers
        self.l2_norm_eps = config.rms_norm_eps if config.qk_l2_norm and self.use_rope else None
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias,
                               quant=quant)
        self.o_proj = Linear(self.q_size, config.hidden_size, quant=quant)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_window(layer_index)
        self.rotary = rotary  # shared across layers, not owned
        self.backend = backend
        self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2Hkv) D]
        rotated = not self.use_rope or (self.q_norm is None and self.rotary.rotate_packed_(
            batch.positions, qkv, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated:
            q, k = self.rotary(batch.positions, q, k)
        if self.l2_norm_eps is not None:  # Llama 4
            q, k = _l2_norm(q, self.l2_norm_eps), _l2_norm(k, self.l2_norm_eps)
        if self.window is None:
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale)
        else:
            o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], batch, self.scale, window=self.window)
        out = self.o_proj(o.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.group.all_reduce(out)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, in float32 (Llama 4's q/k norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LlamaMLP(GatedMLP):
    def __init__(self, config: ModelConfig, quant: QuantMethod | None = None, tp: Any = None):
        super().__init__(config.hidden_size, config.intermediate_size, quant, config.hidden_act)
        self.tp = tp  # down is row-parallel: partial sums all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.tp is None else self.tp.group.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, fused_ops=None,
                 quant: QuantMethod | None = None, tp: Any = None, layer_index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.self_attn = LlamaAttention(config, rotary, backend, quant, tp, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.mlp: nn.Module = SparseMoeBlock(config, quant, tp) if config.is_moe_layer(layer_index) else \
            LlamaMLP(config, quant, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(x, batch, kv_cache)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder; `forward` returns hidden states, `compute_logits` only for sampled rows.

    `backend`: the attention backend every layer calls.

    `fused_ops`: optional CPU extension with in-place add+RMSNorm and packed RoPE (fewer op dispatches).

    `quant`: the QuantMethod of every decoder Linear; `lm_head_quant` that of the LM head (default: the
    same). `tp`: a parallel.TPContext when the model is one rank's shard (`config` then has the rank's
    heads, intermediate columns and vocabulary rows): lookups and logits span the whole vocabulary.
    A tied embedding shares lm_head's weight: the same Parameter when lm_head is unquantized, else
    `embed_tokens` is None and lookups unpack lm_head's rows (no float table is kept).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int | None = None,
                 fused_ops=None, quant: QuantMethod | None = None, lm_head_quant: QuantMethod | None = None,
                 tp: Any = None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.attn_backend = backend  # shared by every layer; prepare(batch) once per forward
        positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config.head_dim, positions, config.rope_theta, config.rope_scaling_dict,
                                      fused_ops, config.rotary_dim, config.rope_freq_factors)
        head_quant = lm_head_quant or quant or UnquantizedMethod()
        self.embed_tokens: nn.Embedding | None = None
        if not (config.tie_word_embeddings and not isinstance(head_quant, UnquantizedMethod)):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        self.layers = self._make_layers(config, backend, fused_ops, quant, tp)
        self.norm: RMSNorm | GemmaRMSNorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, quant=head_quant)
        self.tie_weights()

    def _make_layers(self, config: ModelConfig, backend: AttentionBackend, fused_ops, quant: QuantMethod | None,
                     tp: Any) -> nn.ModuleList:
        """The decoder layers; each returns (x, residual) whose sum is the next layer's input."""
        return nn.ModuleList(LlamaDecoderLayer(config, self.rotary, backend, fused_ops, quant, tp, i)
                             for i in range(config.num_layers))

    def tie_weights(self) -> None:
        """Share the embedding and lm_head Parameter (tied, unquantized); call again after to_empty()."""
        if self.config.tie_word_embeddings and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def process_weights_after_loading(self) -> None:
        """Each Linear's QuantMethod turns its loaded weight into the form it runs on."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quant.process_weights_after_loading(module)
        for block in self.moe_blocks():
            block.stack_experts()
            block.prepare_router()

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] → [T, hidden] in the model dtype."""
        if self.tp is not None:
            return self.tp.embed(self._embed_local, input_ids)
        return self._embed_local(input_ids)

    def _embed_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return self.lm_head.quant.embed(self.lm_head, input_ids, self.norm.weight.dtype)

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache], num_layers: int | None = None) -> torch.Tensor:
        """Hidden states [T, hidden]. The runner attaches the step's attention metadata; callers that
        do not (tests, benchmarks) get it prepared here, still once for all layers. `num_layers`: run
        only the first layers, then the final norm (the layer_skip draft; kv_caches has that many)."""
        if batch.attn_metadata is None:
            batch = batch.with_attn_metadata(self.attn_backend.prepare(batch))
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
        x = self.embed(batch.input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(layers, kv_caches):
            x, residual = layer(x, residual, batch, kv_cache)
        x, _ = self.norm.forward_residual(x, cast(torch.Tensor, residual))  # set by the first layer
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] → [N, vocab] float32 logits (gathered from every rank's vocabulary slice)."""
        logits = self.lm_head(hidden).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)
