"""Model-based proposers for speculative decoding: a smaller draft model (method draft_model) or the
target's own first layers plus its norm and LM head (layer_skip) guess the next K tokens one at a
time, sampled from the draft's processed distribution q (argmax for greedy requests), so that
rejection sampling against the target (speculative.py) keeps the output exact.

KV cache: the draft keeps its own K/V tensors, indexed by the target's block ids, so one block
manager does the accounting: a block the engine gives a request holds that request's target K/V
and its draft K/V. Positions the target has committed (before P, the position of the newest sampled
token) are written into the request's own blocks; the guesses at P and past it go to the request's
own partial block or to scratch blocks after the pool that no request owns, so nothing the
scheduler trims, frees or shares is relied on past what the target itself keeps.

Per request the proposer remembers how many positions its K/V covers (`computed`). Each propose
feeds the tokens from there up to P as one varlen chunk (the whole prompt the first time, or after
a preemption), then runs K-1 single-token decode steps for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ferrylm.config import ModelConfig
from ferrylm.model.arch.llama import KVCache, LlamaForCausalLM
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.sampler import (
    SamplingBatch,
    SamplingRequestState,
    make_generator,
    processed_logits,
    sampling_probs,
)


class DraftInput(NamedTuple):
    """One request to draft for: its tokens (the last is the newest sampled one, at position P,
    whose target K/V is not computed yet) and its block table (covers every position before P)."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]


class Draft(NamedTuple):
    """K proposed tokens and, for sampled requests, the distribution q each was drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None  # [K, V] float32; None for greedy requests (argmax, a one-hot q)


class ModelProposer:
    """Drafts with `model`'s first `num_layers` layers (all of a draft model's; a prefix of the target's
    for layer_skip) over K/V tensors of its own: `num_pool_blocks` blocks shaped like the engine's pool
    plus scratch blocks for `max_batch` requests' guesses."""

    def __init__(self, model: LlamaForCausalLM, num_layers: int, k: int, num_pool_blocks: int, block_size: int,
                 max_batch: int, max_model_len: int, eos_token_ids: list[int], dtype: torch.dtype,
                 device: torch.device):
        self.model, self.num_layers, self.k = model, num_layers, k
        self.block_size, self.max_batch, self.max_model_len = block_size, max_batch, max_model_len
        self.eos_token_ids, self.device = eos_token_ids, device
        self.vocab_size = model.config.vocab_size
        self.scratch_base = num_pool_blocks
        self.scratch_per_request = -(-k // block_size)
        total = num_pool_blocks + max_batch * self.scratch_per_request
        self.kv_caches = allocate_draft_kv(model.config, num_layers, total, block_size, dtype, device)
        self.computed: dict[str, int] = {}  # positions whose draft K/V is valid, per request

    def forget(self, request_id: str) -> None:
        """The request finished, is new, or lost its blocks (preempted): its draft K/V is gone."""
        self.computed.pop(request_id, None)

    def propose(self, inputs: Sequence[DraftInput], states: Sequence[SamplingRequestState]) -> list[Draft]:
        """K tokens per input (at most `max_batch` inputs; one whose guesses would pass the context
        window gets none)."""
        if len(inputs) > self.max_batch:
            raise ValueError(f"{len(inputs)} requests to draft for, at most {self.max_batch}")
        rows = [i for i, item in enumerate(inputs) if len(item.token_ids) - 1 + self.k <= self.max_model_len]
        drafts = [Draft([], None) for _ in inputs]
        if not rows:
            return drafts
        positions = [len(inputs[i].token_ids) - 1 for i in rows]
        tables = [self._table(inputs[i].block_ids, p, slot) for slot, (i, p) in enumerate(zip(rows, positions))]
        starts = [min(self.computed.get(inputs[i].request_id, 0), p) for i, p in zip(rows, positions)]
        chunks = [inputs[i].token_ids[s:p + 1] for i, s, p in zip(rows, starts, positions)]
        row_states = [states[i] for i in rows]
        guessed: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        logits = self._logits(ForwardBatch.build(chunks, starts, tables, self.block_size, None, self.device))
        for j in range(self.k):
            tokens, q = self._choose(logits, row_states, guessed)
            for r, token in enumerate(tokens):
                guessed[r].append(token)
                if q is not None:
                    probs[r].append(q[r])
            if j + 1 < self.k:
                batch = ForwardBatch.build([[t] for t in tokens], [p + j + 1 for p in positions], tables,
                                           self.block_size, None, self.device)
                logits = self._logits(batch)
        for r, (i, p) in enumerate(zip(rows, positions)):
            self.computed[inputs[i].request_id] = p  # the guesses' K/V (position p on) is not kept
            drafts[i] = Draft(guessed[r], torch.stack(probs[r]) if probs[r] else None)
        return drafts

    def _table(self, block_ids: list[int], position: int, slot: int) -> list[int]:
        """The request's blocks that hold positions before `position`, then scratch blocks (the
        `slot`-th request's) for the rest of the K positions the draft writes."""
        bs = self.block_size
        real = list(block_ids[:-(-position // bs)])
        needed = -(-(position + self.k) // bs) - len(real)
        base = self.scratch_base + slot * self.scratch_per_request
        return real + list(range(base, base + needed))

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        batch = batch.with_attn_metadata(self.model.attn_backend.prepare(batch))
        hidden = self.model(batch, self.kv_caches, num_layers=self.num_layers)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def _choose(self, logits: torch.Tensor, states: Sequence[SamplingRequestState],
                guessed: list[list[int]]) -> tuple[list[int], torch.Tensor | None]:
        """Each row's next guess on the draft's processed distribution, with the request's penalties,
        bias and min_tokens seeing its guesses so far as generated: argmax for greedy requests, a draw
        from q (with the request's own generator when seeded) for the others."""
        for state in states:
            if state.params.seed is not None and not state.params.greedy and state.generator is None:
                state.generator = make_generator(state.params.seed, self.device)
        virtual = [SamplingRequestState(s.params, s.prompt_token_ids, s.output_token_ids + g, s.generator)
                   for s, g in zip(states, guessed)]
        sampling = SamplingBatch.build(virtual, self.vocab_size, self.eos_token_ids, self.device)
        processed = processed_logits(logits, sampling)
        tokens = processed.argmax(dim=-1).tolist()
        if sampling.all_greedy:
            return tokens, None
        q = sampling_probs(processed, sampling)
        for r, state in enumerate(states):
            if not state.params.greedy:
                tokens[r] = int(torch.multinomial(q[r], 1, generator=state.generator))
        return tokens, q


def allocate_draft_kv(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def draft_kv_bytes_per_block(config: ModelConfig, num_layers: int, block_size: int, dtype: torch.dtype) -> int:
    """What one pool block costs in the draft's K/V (both tensors, every draft layer)."""
    return 2 * num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize
