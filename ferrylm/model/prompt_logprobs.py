"""vLLM's prompt_logprobs, computed from the prefill's own hidden states (no second pass): for each
prompt position whose next token is in the prompt too, that token's logprob and rank under the raw
model distribution (no temperature, penalties or bias, as vLLM reports them) and the top-k
alternatives. Rows go through the LM head a slice at a time, so a long prompt never holds
[prompt_len, vocab] logits at once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from ferrylm.executor import PromptLogprob
from ferrylm.model.sampler import SamplingRequestState
from ferrylm.scheduler_output import ScheduledRequest

SLICE_ROWS = 256  # LM-head rows at a time: 256 x 49k vocab x fp32 = 50 MB


class PromptRows(NamedTuple):
    """The rows of one request's chunk in this step's flat batch that score a prompt token."""

    request_id: str
    flat_rows: list[int]
    targets: list[int]  # the prompt token each row scores
    first_position: int
    k: int


def plan(scheduled: Sequence[ScheduledRequest], states: Mapping[str, SamplingRequestState]) -> list[PromptRows]:
    """The rows to score this step: chunks of requests that asked for prompt logprobs, minus the
    last prompt position (its logits sample the first output token)."""
    plans, offset = [], 0
    for item in scheduled:
        state = states[item.request_id]
        k = state.params.prompt_logprobs
        prompt = state.prompt_token_ids
        start, end = item.num_computed_tokens, min(item.num_computed_tokens + len(item.token_ids), len(prompt) - 1)
        if k is not None and start < end:
            plans.append(PromptRows(item.request_id, list(range(offset, offset + end - start)),
                                    prompt[start + 1:end + 1], start + 1, k))
        offset += len(item.token_ids)
    return plans


@torch.inference_mode()
def compute(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
            plans: Sequence[PromptRows]) -> dict[str, list[PromptLogprob]]:
    """Score the planned rows of `hidden` ([tokens, hidden_size]); `lm_head` gives float32 logits."""
    rows = torch.tensor([r for p in plans for r in p.flat_rows], device=hidden.device)
    targets = torch.tensor([t for p in plans for t in p.targets], device=hidden.device)
    k_max = max(p.k for p in plans)
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, len(rows), SLICE_ROWS):
        logprobs = torch.log_softmax(lm_head(hidden.index_select(0, rows[lo:lo + SLICE_ROWS])), dim=-1)
        tgt = targets[lo:lo + SLICE_ROWS]
        mine = logprobs.gather(1, tgt[:, None])
        chosen += mine[:, 0].tolist()
        ranks += ((logprobs > mine).sum(dim=1) + 1).tolist()
        if k_max:
            vals, ids = logprobs.topk(k_max, dim=-1)
            top_vals += vals.tolist()
            top_ids += ids.tolist()
    out: dict[str, list[PromptLogprob]] = {}
    i = 0
    for p in plans:
        scored = []
        for j, target in enumerate(p.targets):
            entries = {target: chosen[i]}
            if p.k:
                for tid, val in zip(top_ids[i][:p.k], top_vals[i][:p.k]):
                    entries.setdefault(tid, val)
            scored.append(PromptLogprob(p.first_position + j, entries, ranks[i]))
            i += 1
        out[p.request_id] = scored
    return out
