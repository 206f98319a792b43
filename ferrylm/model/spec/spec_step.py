"""The runner's side of speculative decoding (--speculative-config): proposing drafts after a step,
laying drafted sequences out as decode rows, and verifying their logits. The algorithms are in
speculative.py; the scheduler's side (drafts inside the budget, rejected slots trimmed) is
engine/scheduler.py."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ferrylm.config import SpeculativeConfig
from ferrylm.executor import TokenLogprobs
from ferrylm.model.cpu.cpu_isa import this_cpu
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.sampler import (
    SamplingBatch,
    SamplingRequestState,
    make_generator,
    processed_logits,
    rows_logprobs,
    sampling_probs,
)
from ferrylm.model.spec.draft_proposer import Draft, DraftInput, ModelProposer
from ferrylm.model.spec.speculative import DraftBackoff, NgramProposer, rejection_sample, verify_greedy
from ferrylm.model.structured.structured_output import mask_draft_rows
from ferrylm.scheduler_output import ScheduledRequest

log = logging.getLogger("ferrylm.runner")

# Steps with more sampled sequences than this propose no drafts (--speculative-config
# disable_by_batch_size overrides): past it, verifying costs more than it saves (bench/speculative.py).
# It depends on the machine: with AMX (and on GPUs) drafts paid up to 8 concurrent sequences (1.15-1.26x);
# on a CPU without AMX the int8 decode kernels are compute-bound, verifying k + 1 rows costs nearly k + 1
# single rows, and drafting lost from 2 concurrent sequences on (AMD EPYC Zen 4: 0.83x at 2, 0.71x at 8)
# while one stream still gained 1.68x.
DEFAULT_SPEC_MAX_BATCH = 8
DEFAULT_SPEC_MAX_BATCH_CPU_WITHOUT_AMX = 1


class Verification(NamedTuple):
    sampled: dict[str, int]  # the target's own token per drafted request (emitted last)
    accepted: dict[str, list[int]]  # the draft prefix kept, emitted before it
    logprobs: dict[str, TokenLogprobs]  # of the sampled token, for requests that asked for logprobs
    accepted_logprobs: dict[str, list[TokenLogprobs]]  # of each kept draft token, likewise


def build_batch(scheduled: Sequence[ScheduledRequest], block_size: int, device: torch.device,
                one_row_per_token: bool = False) -> ForwardBatch:
    """The step's ForwardBatch. A drafted sequence becomes one decode row per token (the last
    committed one, then each draft token), row j attending to its context plus the j tokens before
    it: each layer writes every row's K/V before attending, so this is exactly causal. A decode
    batch with drafts thus stays decode-only: the decode kernel, the compiled step.
    `one_row_per_token`: a prefill chunk is laid out the same way (its last row sampled when the
    chunk ends the prompt), so a step mixing small chunks with decodes runs the compiled step too."""
    tokens: list[list[int]] = []
    contexts: list[int] = []
    tables: list[list[int]] = []
    rows: list[int] = []
    for s in scheduled:
        if s.draft_token_ids or (one_row_per_token and len(s.token_ids) > 1):
            first = len(tokens)
            tokens += [[t] for t in s.token_ids]
            contexts += range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))
            tables += [s.block_ids] * len(s.token_ids)
            if s.draft_token_ids:
                rows += range(first, len(tokens))
            elif s.sample:
                rows.append(len(tokens) - 1)
        else:
            if s.sample:
                rows.append(len(tokens))
            tokens.append(s.token_ids)
            contexts.append(s.num_computed_tokens)
            tables.append(s.block_ids)
    return ForwardBatch.build(tokens, contexts, tables, block_size, rows, device)


class Speculator:
    """Owns the proposer and each request's backoff; the runner calls propose() after sampling and
    verify() for the rows that carried a draft. `model_proposer`: the draft model or layer_skip
    proposer (draft_proposer.py) for those methods; the n-gram proposer needs none."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 model_proposer: ModelProposer | None = None):
        self.config = config
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.model_proposer = model_proposer
        self.max_batch = max_spec_batch(config, device)
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device
        self.backoff: dict[str, DraftBackoff] = {}
        self.pending: dict[str, Draft] = {}  # each request's last draft with its q, until verified

    def forget(self, request_id: str) -> None:
        self.backoff.pop(request_id, None)
        self.lost_blocks(request_id)

    def lost_blocks(self, request_id: str) -> None:
        """The request's KV blocks were freed (preempted, finished): nothing drafted over them holds."""
        self.pending.pop(request_id, None)
        if self.model_proposer is not None:
            self.model_proposer.forget(request_id)

    def propose(self, items: Sequence[ScheduledRequest],
                states: dict[str, SamplingRequestState]) -> dict[str, list[int]]:
        """Drafts for the next step for the requests sampled in this one (`items`), for those that can
        be verified exactly here; none when the batch is large. Guided requests are drafted for:
        verification masks each position with the grammar (a guess it refuses is rejected); requests
        asking for logprobs get each emitted token's from its own position's row."""
        for item in items:
            self.pending.pop(item.request_id, None)
        if len(items) > self.max_batch:
            return {}
        eligible = [item for item in items if self.backoff.setdefault(item.request_id, DraftBackoff()).allows()]
        if self.model_proposer is None:
            drafts = {item.request_id: self.proposer.propose(_all_tokens(states[item.request_id]))
                      for item in eligible}
            return {rid: draft for rid, draft in drafts.items() if draft}
        inputs = [DraftInput(item.request_id, _all_tokens(states[item.request_id]), item.block_ids)
                  for item in eligible]
        proposals = self.model_proposer.propose(inputs, [states[item.request_id] for item in eligible])
        out = {}
        for item, draft in zip(eligible, proposals):
            if draft.token_ids:
                self.pending[item.request_id] = draft
                out[item.request_id] = draft.token_ids
        return out

    def verify(self, logits: torch.Tensor, items: Sequence[ScheduledRequest],
               states: dict[str, SamplingRequestState]) -> Verification:
        """`logits` [sum(1 + len(draft)), V]: each drafted item's rows in order. Greedy requests keep
        the longest draft prefix equal to the argmax, sampled ones are rejection-sampled, all on the
        distribution a plain step would use at that position (penalties and min_tokens see the draft
        prefix as generated); each then takes one token of the target's own."""
        drafts, logits = _grammar_masked(logits, items, states)
        virtual = []  # one sampling row per draft position: its prefix as if already generated
        for item, draft in zip(items, drafts):
            state = states[item.request_id]
            virtual += [SamplingRequestState(state.params, state.prompt_token_ids,
                                             state.output_token_ids + draft[:j]) for j in range(1 + len(draft))]
        sampling = SamplingBatch.build(virtual, self.vocab_size, self.eos_token_ids, self.device)
        processed = processed_logits(logits, sampling)
        probs = None if sampling.all_greedy else sampling_probs(processed, sampling)
        sampled, accepted = {}, {}
        logprobs: dict[str, TokenLogprobs] = {}
        accepted_logprobs: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        for item, draft in zip(items, drafts):
            rid = item.request_id
            state, n = states[rid], 1 + len(draft)
            if state.params.greedy:
                verified = verify_greedy(processed[offset:offset + n].unsqueeze(0), [draft])
            else:
                if state.params.seed is not None and state.generator is None:
                    state.generator = make_generator(state.params.seed, self.device)
                assert probs is not None
                verified = rejection_sample(probs[offset:offset + n].unsqueeze(0),
                                            torch.tensor([draft], device=self.device), self._draft_q(rid, draft),
                                            state.generator)
            tokens = verified.tokens[0]
            if state.params.logprobs is not None:  # each emitted token's row, as a plain step would give
                rows = rows_logprobs(processed[offset:offset + len(tokens)], tokens, state.params.logprobs)
                logprobs[rid], accepted_logprobs[rid] = rows[-1], rows[:-1]
            offset += n
            state.output_token_ids.extend(tokens)
            sampled[rid], accepted[rid] = tokens[-1], tokens[:-1]
            if state.grammar is not None:
                for token in tokens:
                    if not state.grammar.accept_token(token):
                        log.warning("request %s: token %d rejected by its grammar", rid, token)
                        break
            self.backoff.setdefault(rid, DraftBackoff()).record(len(item.draft_token_ids), verified.num_accepted[0])
        return Verification(sampled, accepted, logprobs, accepted_logprobs)

    def _draft_q(self, request_id: str, draft: list[int]) -> torch.Tensor | None:
        """[1, len(draft), V]: the distribution the model proposer drew `draft` from (the scheduler may
        have cut it); None for n-gram drafts (a one-hot q)."""
        pending = self.pending.pop(request_id, None)
        if self.model_proposer is None:
            return None
        if pending is None or pending.probs is None or pending.token_ids[:len(draft)] != draft:
            raise RuntimeError(f"request {request_id}: the draft to verify is not the one proposed")
        return pending.probs[:len(draft)].unsqueeze(0)


def _grammar_masked(logits: torch.Tensor, items: Sequence[ScheduledRequest],
                    states: dict[str, SamplingRequestState]) -> tuple[list[list[int]], torch.Tensor]:
    """Each item's draft as verified, and its logits rows: a guided request's rows masked by its
    grammar after each draft prefix, its draft cut at the first guess the grammar refuses or ends
    on (structured_output.mask_draft_rows); the rows past a cut are dropped."""
    drafts: list[list[int]]
    keep: list[int]
    drafts, keep = [], []
    offset = 0
    for item in items:
        draft, grammar = list(item.draft_token_ids), states[item.request_id].grammar
        if grammar is not None:
            draft = draft[:mask_draft_rows(logits, offset, grammar, draft)]
        drafts.append(draft)
        keep += range(offset, offset + 1 + len(draft))
        offset += 1 + len(item.draft_token_ids)
    if len(keep) != logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))
    return drafts, logits


def max_spec_batch(config: SpeculativeConfig, device: torch.device) -> int:
    """Most sampled sequences in a step that still proposes drafts (on `device`)."""
    if config.disable_by_batch_size is not None:
        return config.disable_by_batch_size
    if device.type == "cpu" and "amx_tile" not in this_cpu().flags:
        return DEFAULT_SPEC_MAX_BATCH_CPU_WITHOUT_AMX
    return DEFAULT_SPEC_MAX_BATCH


def _all_tokens(state: SamplingRequestState) -> list[int]:
    return state.prompt_token_ids + state.output_token_ids


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


