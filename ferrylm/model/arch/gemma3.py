"""Gemma 3 (text): the Llama decoder's attention and gated MLP with Gemma's differences.

- Embeddings times sqrt(hidden_size), rounded to the model dtype first (as transformers does).
- Gemma RMSNorm, x * (1 + w) in float32, four per layer: the attention and MLP outputs are normed
  before they join the residual stream, as are their inputs.
- q/k RMSNorm per head before RoPE; attention scale query_pre_attn_scalar ** -0.5.
- Layers in config.sliding_layers attend to their last sliding_window positions (the backend masks
  older keys; their KV blocks are kept) with RoPE base local_rope_theta, unscaled; the others
  attend fully with rope_theta and rope_scaling.
- GELU (tanh) gated MLP, tied embeddings, optional tanh soft cap on the logits.

Shapes: T = tokens in the flat batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrylm.config import ModelConfig
from ferrylm.model.arch.layers import GemmaRMSNorm, RotaryEmbedding
from ferrylm.model.arch.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP
from ferrylm.model.attention.base import AttentionBackend
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.quant.base import QuantMethod


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP. Keeps LlamaDecoderLayer's contract: it takes and
    returns (x, residual) whose sum is the hidden state, so LlamaForCausalLM.forward drives it."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantMethod | None, tp: Any, layer_index: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = LlamaAttention(config, rotary, backend, quant, tp, layer_index, qk_norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = LlamaMLP(config, quant, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv_cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else residual + x  # [T, hidden]
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), batch, kv_cache))
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))), h


class Gemma3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with Gemma 3's layers, final norm, embedding scale and logit soft cap.
    `rotary` is the full-attention layers' RoPE, `local_rotary` the sliding layers'."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int | None = None,
                 fused_ops=None, quant: QuantMethod | None = None, lm_head_quant: QuantMethod | None = None,
                 tp: Any = None):
        super().__init__(config, backend, max_positions, fused_ops, quant, lm_head_quant, tp)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def _make_layers(self, config: ModelConfig, backend: AttentionBackend, fused_ops, quant: QuantMethod | None,
                     tp: Any) -> nn.ModuleList:
        self.local_rotary = RotaryEmbedding(config.head_dim, self.rotary.max_positions,
                                            config.local_rope_theta or config.rope_theta, None)
        return nn.ModuleList(
            Gemma3DecoderLayer(config, self.local_rotary if i in config.sliding_layers else self.rotary, backend,
                               quant, tp, i)
            for i in range(config.num_layers))

    def _embed_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed_local(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)  # float32, then the model dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
