"""Iteration-level scheduler: one token budget per step shared by decodes, prefill chunks and
prefix hits; when KV blocks run out, preemption by recompute or by swap to host blocks
(--preemption-mode, engine/preemption.py). Pure Python, ids only."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ferrylm.config import SchedulerConfig
from ferrylm.engine.block_manager import BlockKey, BlockManager
from ferrylm.engine.host_pool import HostBlockPool
from ferrylm.engine.preemption import PreemptionPolicy
from ferrylm.engine.request import Request, RequestStatus
from ferrylm.engine.step_cost import StepCostModel
from ferrylm.outputs import FinishReason
from ferrylm.request_limits import ContextLengthExceeded, check_context_window
from ferrylm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


class RequestRejected(ValueError):
    """A request that can never be served (too long for the context window or the KV pool).

    `param` names the offending request field when there is one, like SamplingParamsError, so
    the server's 400 can point at it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SchedulerStats(NamedTuple):
    num_waiting: int
    num_running: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec: "SpecCounters"
    num_swapped: int = 0  # requests whose KV blocks are in host memory now (counted apart from num_waiting)
    num_swapped_out: int = 0  # cumulative: swap preemptions
    num_swapped_in: int = 0  # cumulative: swapped requests brought back
    num_swap_fallbacks: int = 0  # cumulative: swaps wanted but recomputed (host pool full)


@dataclass
class SpecCounters:
    """Speculative decoding so far (vLLM's spec_decode metrics): verifying steps, draft tokens
    scheduled, of those accepted, and accepted per draft position (index 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


MAX_DISK_WAITS = 3  # steps a request waits for host blocks to read its prefix from disk into


class Scheduler:
    """Waiting queue ordered by (priority, arrival); running queue in the same order. A swapped-out
    request keeps its place in the waiting queue (status SWAPPED) and is swapped in when reached.

    `host_pool`: host blocks for swap preemption (none: always recompute); `preemption` decides per
    victim (default: the config's mode with the measured cost model, blocks of `0` bytes);
    `max_loras`: LoRA adapters the runner holds at once (None: no adapters served)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 host_pool: HostBlockPool | None = None, preemption: PreemptionPolicy | None = None,
                 max_loras: int | None = None):
        self.config = config
        self.max_loras = max_loras  # --max-loras under --enable-lora: distinct adapters running at once
        self.block_manager = block_manager
        self.host_pool = host_pool if host_pool is not None else HostBlockPool(0)
        self.preemption = preemption if preemption is not None else PreemptionPolicy(config.preemption_mode)
        self._swap_out: list[tuple[int, int]] = []  # this step's copy orders (device, host) / (host, device)
        self._swap_in: list[tuple[int, int]] = []
        self.num_swapped_out = self.num_swapped_in = self.num_swap_fallbacks = 0
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._known_to_runner: set[str] = set()
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []  # since the last schedule(): the runner drops what it drafted over them
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0  # prompt tokens not recomputed: device pool and host tier hits
        self.tier_hit_tokens = 0  # the share of prefix_cache_hits loaded back from the host tier
        self.spec = SpecCounters()
        self.step_cost = StepCostModel()
        # this step's seconds left per cache root (tenant) for its prompt tokens, under
        # --decode-isolation-headroom; a root's first chunk of a step takes at least one token
        self._allowance: dict[int, float] = {}
        self._progressed: set[int] = set()
        self._isolated_roots: set[int] = set()  # roots whose prompts are capped this step

    def observe_step(self, tokens: int, seconds: float, scored: int = 0) -> None:
        """The engine's measure of a step it ran (its scheduled tokens, `scored` of them prompt tokens
        scored for prompt_logprobs; the execute's seconds)."""
        self.step_cost.observe(tokens, seconds, scored)

    # -- admission -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejected if it could never complete."""
        total = request.num_prompt_tokens + request.max_tokens
        if request.num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        try:
            check_context_window(request.num_prompt_tokens, request.max_tokens, self.max_model_len)
        except ContextLengthExceeded as e:
            raise RequestRejected(str(e), e.param) from None
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise RequestRejected(
                f"the request needs {total} tokens of KV cache, more than the whole pool "
                f"({self.block_manager.num_blocks * self.block_manager.block_size} tokens)")
        if request.request_id in self.requests:
            raise RequestRejected(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        sp = request.sampling_params
        if sp.prompt_logprobs is None and sp.pooling not in ("mean", "cls"):  # those compute every position
            request.probed_cached_tokens = self.block_manager.probe_cached_tokens(request.token_ids,
                                                                                  request.cache_root)
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.sort_key), request)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        self._isolate_decodes()
        budget, preempted = self._schedule_running(scheduled, budget)
        new_requests: list[NewRequestData] = []
        if not preempted:
            budget = self._schedule_waiting(scheduled, new_requests, budget)
        finished, self._finished_ids = self._finished_ids, []
        lost, self._preempted_ids = tuple(self._preempted_ids), []
        tier_out, tier_in = self.block_manager.take_tier_orders()
        out, into = tuple(self._swap_out + tier_out), tuple(self._swap_in + tier_in)
        self._swap_out, self._swap_in = [], []
        return SchedulerOutput(scheduled, new_requests, finished, self.config.max_num_batched_tokens - budget, lost,
                               out, into, self.block_manager.take_disk_orders())

    def _schedule_running(self, scheduled: list[ScheduledRequest], budget: int) -> tuple[int, bool]:
        """Advance running requests in priority order, preempting the least important on OOM."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, req)
            if n <= 0:
                i += 1
                continue
            draft = self._draft(req, budget) if n == 1 else []
            n += len(draft)
            while not self._allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: everything after it is gone too
            scheduled.append(self._scheduled(req, n - len(draft), draft))
            budget -= n
            i += 1
        return budget, preempted

    def _chunk(self, remaining: int, budget: int, req: Request | None = None) -> int:
        """The tokens of a request this step: what remains, within the budget, the per-request
        prefill cap (--long-prefill-token-threshold) and, for a prompt chunk of `req`, what its
        tenant may still add beside other tenants' decodes (--decode-isolation-headroom)."""
        cap = self.config.long_prefill_token_threshold if self.config.enable_chunked_prefill else 0
        n = min(remaining, budget, cap) if cap else min(remaining, budget)
        # a prompt token even when it is the last one (a decode row is past the prompt): n samples of
        # one prompt, each computing its last prompt token, are n prompt tokens, not n decode rows
        if req is not None and (remaining > 1 or req.num_computed_tokens < req.num_prompt_tokens) \
                and req.tenant_root in self._isolated_roots:
            root = req.tenant_root
            cost = self.step_cost.token_seconds(req.sampling_params.prompt_logprobs is not None)  # > 0 once fitted
            fits = int(self._allowance[root] / cost) if cost else 0
            if root not in self._progressed:
                fits = max(fits, 1)
            n = min(n, fits)
            if n > 0:
                self._progressed.add(root)
                self._allowance[root] -= n * (cost or 0.0)
        return n

    def _isolate_decodes(self) -> None:
        """This step's prompt-token allowance per tenant: a tenant whose prompts would share the step
        with another tenant's decode rows gets what the headroom leaves (step_cost.py)."""
        self._isolated_roots, self._progressed = set(), set()
        headroom = self.config.decode_isolation_headroom
        if not headroom or not self.config.enable_chunked_prefill:
            return
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return
        step = self.step_cost.step_seconds(len(decoding))
        allowance = 0.0 if step is None else headroom * step
        roots = {r.tenant_root for r in decoding}
        prompting = {r.tenant_root for r in self.running + self.waiting}
        self._isolated_roots = {root for root in prompting if roots - {root}}
        self._allowance = dict.fromkeys(self._isolated_roots, allowance)

    def _draft(self, req: Request, budget: int) -> list[int]:
        """The runner's proposal for a decoding request, cut so that accepting all of it (plus the
        target's own token) stays within the budget, max_tokens and the context window."""
        if not req.spec_token_ids:
            return []
        room = min(budget, req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return req.spec_token_ids[:max(room, 0)]

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], new_requests: list[NewRequestData],
                          budget: int) -> int:
        """Admit waiting requests in order while budget, sequence slots and blocks allow (swapped
        ones are swapped in at their place in that order). Runs only in a step that preempted
        nothing, so no step both swaps out and swaps in (each direction frees what the other takes)."""
        i = 0  # requests whose grammar still compiles are passed over, not waited for
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}  # grows as requests are admitted
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            if not self._adapter_fits(req, adapters):  # its adapter waits for a slot; the next in line may go
                i += 1
                continue
            if req.status == RequestStatus.SWAPPED:
                n = self._swap_in_request(req, budget)
                if n is None:
                    break
                self.waiting.pop(i)
                self._admit(req, req.num_computed_tokens)
                if req.lora_name is not None:
                    adapters.add(req.lora_name)
                scheduled.append(self._scheduled(req, n))
                budget -= n
                continue
            if req.grammar_pending:
                i += 1
                continue
            # prompt logprobs come from the prefill's logits, mean / cls pooling from its hidden states:
            # such a request computes every position
            every_position = req.sampling_params.prompt_logprobs is not None or \
                req.sampling_params.pooling in ("mean", "cls")
            cached = [] if every_position else self.block_manager.find_cached_prefix(req.token_ids, req.cache_root)
            # the host tier may hold the blocks after the device pool's (loaded back before the forward)
            tier = [] if every_position else \
                self.block_manager.tier_continuation(req.token_ids, cached, req.cache_root)
            if not every_position and self._wait_for_disk(req, cached, tier):
                i += 1  # its blocks come up from disk this step; the next in line may go
                continue
            num_cached = (len(cached) + len(tier)) * self.block_manager.block_size
            n = req.num_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
            n = self._chunk(n, budget, req)
            if n <= 0:  # its tenant's prompt allowance is spent this step: the next in line may go
                i += 1
                continue
            if not self.block_manager.allocate_slots(req.request_id, req.token_ids, num_cached, n, cached,
                                                     req.cache_root, tier):
                break
            if req.num_preemptions == 0:
                self.tier_hit_tokens += len(tier) * self.block_manager.block_size
            self.waiting.pop(i)
            self._admit(req, num_cached)
            if req.lora_name is not None:
                adapters.add(req.lora_name)
            if req.request_id not in self._known_to_runner:
                self._known_to_runner.add(req.request_id)
                new_requests.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                                   req.grammar_ref, req.lora_name))
            scheduled.append(self._scheduled(req, n))
            budget -= n
        return budget

    def _wait_for_disk(self, req: Request, cached: list[int], tier: list[BlockKey]) -> bool:
        """Once per request: order the disk tier's blocks that continue its cached prefix read into the
        host tier, and pass it over this step (next step they are host-tier hits, or recomputed if a
        file proved bad). When every host block is taken by other requests' reads this step, it waits
        for the next (a few steps at most). True: pass it over this step."""
        if req.disk_checked or self.block_manager.disk is None:
            return False
        keys = self.block_manager.disk_continuation(req.token_ids, cached, tier, req.cache_root)
        ordered = self.block_manager.load_from_disk(keys, req.cache_root, tier) if keys else 0
        req.disk_waits += 1
        req.disk_checked = ordered > 0 or not keys or req.disk_waits > MAX_DISK_WAITS
        return not req.disk_checked or ordered > 0

    def _adapter_fits(self, req: Request, active: set[str]) -> bool:
        """At most max_loras distinct LoRA adapters among the running requests (the runner's slots);
        `active`: theirs (the caller adds each request's it admits)."""
        if req.lora_name is None or self.max_loras is None:
            return True
        return req.lora_name in active or len(active) < self.max_loras

    def _swap_in_request(self, req: Request, budget: int) -> int | None:
        """Fresh private device blocks for a swapped request (its host copies go to the first ones,
        the rest take this step's new tokens); the tokens it computes now, or None if it cannot."""
        n = req.num_tokens - req.num_computed_tokens
        if n > budget:
            if not self.config.enable_chunked_prefill:
                return None
            n = budget
        if not self._allocate(req, n):
            return None
        host = self.host_pool.free(req.request_id)
        self._swap_in.extend(zip(host, self.block_manager.block_table(req.request_id)))
        self.num_swapped_in += 1
        return n

    def _admit(self, req: Request, num_cached: int) -> None:
        if req.num_preemptions == 0:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
            req.num_cached_tokens = num_cached
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        keys = [r.sort_key for r in self.running]
        self.running.insert(bisect.bisect(keys, req.sort_key), req)

    def _allocate(self, req: Request, n: int) -> bool:
        return self.block_manager.allocate_slots(req.request_id, req.token_ids, req.num_computed_tokens, n,
                                                 root=req.cache_root)

    def _scheduled(self, req: Request, n: int, draft: list[int] | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req.request_id, req.token_ids[start:start + n] + (draft or []), start,
                                self.block_manager.block_table(req.request_id),
                                start + n == req.num_tokens and req.max_tokens > 0, tuple(draft or ()))

    def _preempt(self, req: Request) -> None:
        """Free a running request's device blocks and requeue it (its arrival time puts it in front):
        by swap, its computed blocks copied to host blocks first (shared prefix blocks too: the copy
        is private and comes back into fresh blocks), or by recompute, its progress dropped."""
        self.running.remove(req)
        blocks = self.block_manager.block_table(req.request_id)[:self.block_manager.blocks_needed(
            req.num_computed_tokens)]
        host = self._host_blocks_for(req, len(blocks))
        self.block_manager.free(req.request_id)
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        if host is not None:
            req.status = RequestStatus.SWAPPED
            self._swap_out.extend(zip(blocks, host))
            self.num_swapped_out += 1
        else:
            self._preempted_ids.append(req.request_id)  # the runner's drafts over its blocks are gone
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
        self._enqueue_waiting(req)

    def _host_blocks_for(self, req: Request, num_blocks: int) -> list[int] | None:
        """Host blocks to swap `req` into, or None to recompute it (mode, cost, or a full host pool)."""
        if not num_blocks or not self.host_pool.num_blocks:
            return None
        if not self.preemption.wants_swap(req.num_computed_tokens, num_blocks):
            return None
        host = self.host_pool.allocate(req.request_id, num_blocks)
        if host is None:
            self.num_swap_fallbacks += 1
        return host

    # -- results -------------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, int], accepted: dict[str, list[int]] | None = None,
               drafts: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance progress, append sampled tokens, finish on EOS / stop ids / length.

        `accepted`: per request, the draft tokens the target kept, emitted before its sampled token;
        the slots of the rejected ones are given back. `drafts`: the runner's proposals for the next
        step. Returns the requests that received tokens this step (`num_new_tokens` of them), and
        those with max_tokens 0 whose prompt finished (they end with no token, finish reason length).
        """
        accepted, drafts = accepted or {}, drafts or {}
        updated = []
        for item in output.scheduled:
            req = self.requests.get(item.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            token = sampled.get(item.request_id)
            kept = accepted.get(item.request_id, []) if item.draft_token_ids else []
            req.num_computed_tokens += len(item.token_ids) - len(item.draft_token_ids) + len(kept)
            req.spec_token_ids = drafts.get(item.request_id, [])
            if token is None:
                if req.max_tokens == 0 and req.num_computed_tokens >= req.num_tokens:
                    self.finish_request(req.request_id, FinishReason.LENGTH)
                    updated.append(req)
                continue
            if item.draft_token_ids:
                self.spec.record(len(item.draft_token_ids), len(kept))
                req.metrics.spec_num_drafts += 1
                req.metrics.spec_num_draft_tokens += len(item.draft_token_ids)
                req.metrics.spec_num_accepted_tokens += len(kept)
            updated.append(req)
            req.num_new_tokens = 0
            for t in [*kept, token]:  # nothing past a stop is emitted
                req.token_ids.append(t)
                req.num_new_tokens += 1
                reason = self._check_stop(req, t)
                if reason is not None:
                    self.finish_request(req.request_id, *reason)
                    break
            else:
                if item.draft_token_ids:
                    self.block_manager.trim(req.request_id, req.num_computed_tokens)
        return updated

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason, int | None] | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return FinishReason.STOP, None
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish (or abort) a request wherever it is; its blocks go back to the pool at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(request_id)
        self.host_pool.free(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if request_id in self._known_to_runner:
            self._known_to_runner.discard(request_id)
            self._finished_ids.append(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_swapped(self) -> int:
        return len(self.host_pool.tables)

    def stats(self) -> SchedulerStats:
        swapped = self.num_swapped
        return SchedulerStats(len(self.waiting) - swapped, len(self.running), self.num_preemptions,
                              self.prefix_cache_queries, self.prefix_cache_hits, self.spec, swapped,
                              self.num_swapped_out, self.num_swapped_in, self.num_swap_fallbacks)

    def check_invariants(self) -> None:
        """Queues disjoint and ordered; every running request holds blocks for its computed tokens;
        host blocks are held by exactly the swapped requests, each for all of its computed tokens."""
        self.block_manager.check_invariants()
        swapped = {r.request_id for r in self.waiting if r.status == RequestStatus.SWAPPED}
        self.host_pool.check_invariants(swapped)
        run_ids = {r.request_id for r in self.running}
        wait_ids = {r.request_id for r in self.waiting}
        if run_ids & wait_ids or (run_ids | wait_ids) != set(self.requests):
            raise AssertionError("running/waiting queues disagree with the request table")
        for queue in (self.running, self.waiting):
            if [r.sort_key for r in queue] != sorted(r.sort_key for r in queue):
                raise AssertionError("queue out of priority order")
        for req in self.running:
            have = len(self.block_manager.block_table(req.request_id)) * self.block_manager.block_size
            if have < req.num_computed_tokens:
                raise AssertionError(f"{req.request_id}: {req.num_computed_tokens} computed tokens, {have} slots")
        for req in self.waiting:
            if self.block_manager.block_table(req.request_id):
                raise AssertionError(f"{req.request_id}: waiting but holds blocks")
            held = len(self.host_pool.block_table(req.request_id))
            if held != (self.block_manager.blocks_needed(req.num_computed_tokens)
                        if req.status == RequestStatus.SWAPPED else 0) or (held == 0) != (req.num_computed_tokens == 0):
                raise AssertionError(f"{req.request_id}: {req.status.value} with {req.num_computed_tokens} computed "
                                     f"tokens holds {held} host blocks")
