"""--runner pooling: a prompt's final hidden states (after the last norm, as transformers'
last_hidden_state) pooled into one vector per request: the last token's (decoder models' default,
vLLM's LAST), the mean over every prompt token, or the first token's (CLS); L2-normalised when the
request asks. A prompt prefilled in chunks is pooled across them (mean: a running sum in float32)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ferrylm.model.sampler import SamplingRequestState
from ferrylm.scheduler_output import ScheduledRequest


class PoolRows(NamedTuple):
    request_id: str
    first_row: int  # this step's first row of the request in the batch's token order
    num_rows: int
    starts_prompt: bool  # the chunk holds the prompt's first token
    ends_prompt: bool  # the chunk holds the prompt's last token: the vector is ready


def pooling_rows(scheduled: Sequence[ScheduledRequest], states: Mapping[str, SamplingRequestState]) -> list[PoolRows]:
    """The rows of this step's pooling requests (rows are tokens in order, as in prompt_logprobs.plan)."""
    out, offset = [], 0
    for item in scheduled:
        state = states[item.request_id]
        if state.params.pooling is not None:
            end = item.num_computed_tokens + len(item.token_ids)
            out.append(PoolRows(item.request_id, offset, len(item.token_ids), item.num_computed_tokens == 0,
                                end >= len(state.prompt_token_ids)))
        offset += len(item.token_ids)
    return out


@torch.inference_mode()
def pool(hidden: torch.Tensor, rows: Sequence[PoolRows], states: Mapping[str, SamplingRequestState]
         ) -> dict[str, list[float]]:
    """Fold this step's rows of `hidden` [tokens, hidden_size] into each request's state; the finished
    vectors (float32 lists) by request id."""
    done: dict[str, list[float]] = {}
    for r in rows:
        state = states[r.request_id]
        chunk = hidden[r.first_row:r.first_row + r.num_rows].float()
        kind = state.params.pooling
        if kind == "mean":
            total = chunk.sum(dim=0)
            state.pool = total if state.pool is None else state.pool + total
            state.pooled_rows += r.num_rows
        elif kind == "cls" and r.starts_prompt:
            state.pool = chunk[0].clone()
        if not r.ends_prompt:
            continue
        if kind == "last":
            vector = chunk[-1]
        elif kind == "mean":
            assert state.pool is not None
            vector = state.pool / max(state.pooled_rows, 1)
        else:
            assert state.pool is not None
            vector = state.pool
        if state.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        done[r.request_id] = vector.tolist()
    return done
