"""The runner's side of speculative decoding (--speculative-config): proposing drafts after a step,
laying drafted sequences out as decode rows, and verifying their logits. The algorithms are in
speculative.py; the scheduler's side (drafts inside the budget, rejected slots trimmed) is
engine/scheduler.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ferrylm.config import SpeculativeConfig
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.sampler import (
    SamplingBatch,
    SamplingRequestState,
    make_generator,
    processed_logits,
    sampling_probs,
)
from ferrylm.model.speculative import DraftBackoff, NgramProposer, rejection_sample, verify_greedy
from ferrylm.scheduler_output import ScheduledRequest

# Steps with more sampled sequences than this propose no drafts (--speculative-config
# disable_by_batch_size overrides): past it, verifying costs more than it saves (bench/speculative.py).
DEFAULT_SPEC_MAX_BATCH = 8


class Verification(NamedTuple):
    sampled: dict[str, int]  # the target's own token per drafted request (emitted last)
    accepted: dict[str, list[int]]  # the draft prefix kept, emitted before it


def build_batch(scheduled: Sequence[ScheduledRequest], block_size: int, device: torch.device) -> ForwardBatch:
    """The step's ForwardBatch. A drafted sequence becomes one decode row per token (the last
    committed one, then each draft token), row j attending to its context plus the j tokens before
    it: each layer writes every row's K/V before attending, so this is exactly causal. A decode
    batch with drafts thus stays decode-only: the decode kernel, the compiled step."""
    tokens: list[list[int]] = []
    contexts: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    for s in scheduled:
        if s.draft_token_ids:
            rows += range(len(tokens), len(tokens) + len(s.token_ids))
            tokens += [[t] for t in s.token_ids]
            contexts += range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))
            tables += [s.block_ids] * len(s.token_ids)
        else:
            if s.sample:
                rows.append(len(tokens))
            tokens.append(s.token_ids)
            contexts.append(s.num_computed_tokens)
            tables.append(s.block_ids)
    return ForwardBatch.build(tokens, contexts, tables, block_size, rows, device)


class Speculator:
    """Owns the proposer and each request's backoff; the runner calls propose() after sampling and
    verify() for the rows that carried a draft."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        self.config = config
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        limit = config.disable_by_batch_size
        self.max_batch = DEFAULT_SPEC_MAX_BATCH if limit is None else limit
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device
        self.backoff: dict[str, DraftBackoff] = {}

    def forget(self, request_id: str) -> None:
        self.backoff.pop(request_id, None)

    def propose(self, request_ids: Sequence[str], states: dict[str, SamplingRequestState]) -> dict[str, list[int]]:
        """Drafts for the next step, for requests that can be verified exactly here: no grammar (its
        matcher cannot roll back yet) and no logprobs; none when the batch is large."""
        if len(request_ids) > self.max_batch:
            return {}
        drafts = {}
        for rid in request_ids:
            state = states[rid]
            if state.grammar is not None or state.params.logprobs is not None:
                continue
            if not self.backoff.setdefault(rid, DraftBackoff()).allows():
                continue
            draft = self.proposer.propose(state.prompt_token_ids + state.output_token_ids)
            if draft:
                drafts[rid] = draft
        return drafts

    def verify(self, logits: torch.Tensor, items: Sequence[ScheduledRequest],
               states: dict[str, SamplingRequestState]) -> Verification:
        """`logits` [sum(1 + len(draft)), V]: each drafted item's rows in order. Greedy requests keep
        the longest draft prefix equal to the argmax, sampled ones are rejection-sampled, all on the
        distribution a plain step would use at that position (penalties and min_tokens see the draft
        prefix as generated); each then takes one token of the target's own."""
        virtual = []  # one sampling row per draft position: its prefix as if already generated
        for item in items:
            state = states[item.request_id]
            virtual += [SamplingRequestState(state.params, state.prompt_token_ids,
                                             state.output_token_ids + list(item.draft_token_ids[:j]))
                        for j in range(1 + len(item.draft_token_ids))]
        sampling = SamplingBatch.build(virtual, self.vocab_size, self.eos_token_ids, self.device)
        processed = processed_logits(logits, sampling)
        probs = None if sampling.all_greedy else sampling_probs(processed, sampling)
        sampled, accepted = {}, {}
        offset = 0
        for item in items:
            rid, draft = item.request_id, list(item.draft_token_ids)
            state, n = states[rid], 1 + len(draft)
            if state.params.greedy:
                verified = verify_greedy(processed[offset:offset + n].unsqueeze(0), [draft])
            else:
                if state.params.seed is not None and state.generator is None:
                    state.generator = make_generator(state.params.seed, self.device)
                assert probs is not None
                verified = rejection_sample(probs[offset:offset + n].unsqueeze(0),
                                            torch.tensor([draft], device=self.device), None, state.generator)
            offset += n
            tokens = verified.tokens[0]
            state.output_token_ids.extend(tokens)
            sampled[rid], accepted[rid] = tokens[-1], tokens[:-1]
            self.backoff.setdefault(rid, DraftBackoff()).record(len(draft), verified.num_accepted[0])
        return Verification(sampled, accepted)


def split_rows(counts: Sequence[int]) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """For sampled items with `counts` logits rows each (1 + draft length): the plain items, the
    drafted ones, and the logits rows of each group."""
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    plain = [i for i, c in enumerate(counts) if c == 1]
    drafted = [i for i, c in enumerate(counts) if c > 1]
    return (plain, drafted, torch.tensor([starts[i] for i in plain], dtype=torch.int64),
            torch.tensor([k for i in drafted for k in range(starts[i], starts[i + 1])], dtype=torch.int64))


