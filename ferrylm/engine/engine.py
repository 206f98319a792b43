"""Engine: add_request / abort / step(). One step = schedule → run the model → update → outputs
(output_processor.py: detokenize, stop strings, logprobs, RequestOutput)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

from ferrylm.config import ConfigError, EngineConfig
from ferrylm.engine.adapters import Adapters
from ferrylm.engine.block_manager import BlockManager, block_hashes, root_hash
from ferrylm.engine.disk_tier import DiskPrefixTier
from ferrylm.engine.host_pool import HostBlockPool
from ferrylm.engine.output_processor import OutputProcessor
from ferrylm.engine.preemption import PreemptionPolicy
from ferrylm.engine.prefix_tier import HostPrefixTier
from ferrylm.engine.request import Request
from ferrylm.engine.scheduler import RequestRejected, Scheduler
from ferrylm.executor import Executor, build_executor, build_grammar_compiler
from ferrylm.kv_transfer import KVBlocks, KVLayoutMismatch
from ferrylm.load_report import LoadReport
from ferrylm.outputs import FinishReason, RequestOutput, RequestOutputKind
from ferrylm.request_limits import check_prompt_ids, check_token_ids, resolve_max_tokens
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.scheduler_output import SchedulerOutput
from ferrylm.tokenizer import Tokenizer

log = logging.getLogger("ferrylm.engine")


def _output_left(request: Request) -> int:
    return max(0, request.max_tokens - request.num_output_tokens)


def _prefill_left(request: Request) -> int:
    """Prompt tokens a waiting request still has to compute, less the prefix some cache tier held when
    it arrived: a tier hit is a copy, far cheaper than a prefill (admission's projected wait)."""
    return request.num_tokens - max(request.num_computed_tokens, request.probed_cached_tokens)


def _certain_output_left(request: Request) -> int:
    """Output tokens that will be generated whatever the model says (ignore_eos, min_tokens)."""
    if request.sampling_params.ignore_eos:
        return _output_left(request)
    return min(_output_left(request), max(0, request.sampling_params.min_tokens - request.num_output_tokens))


def _adapter_names(requests: list[Request]) -> list[str]:
    return sorted({r.lora_name for r in requests if r.lora_name is not None})


def _host_tier(config: EngineConfig, executor: Executor) -> HostPrefixTier | None:
    """The prefix cache's host tier: --kv-offload-cpu-gib of the executor's host blocks, after swap's."""
    per_block = executor.swap_bytes_per_block
    if not per_block or not config.cache.kv_offload_cpu_gib or not config.cache.enable_prefix_caching:
        return None
    first = _num_swap_blocks(config, executor)
    size = min(int(config.cache.kv_offload_cpu_gib * (1 << 30)) // per_block, executor.num_host_blocks - first)
    return HostPrefixTier(first, size) if size > 0 else None


def _disk_tier(config: EngineConfig, executor: Executor, tier: HostPrefixTier | None) -> DiskPrefixTier | None:
    """The disk tier's index (--kv-offload-disk-path): --kv-offload-disk-gib of block files, seeded
    with those a previous run of this model left (the runner found them)."""
    if tier is None or config.cache.kv_offload_disk_path is None:
        return None
    capacity = int(config.cache.kv_offload_disk_gib * (1 << 30)) // max(executor.swap_bytes_per_block, 1)
    return DiskPrefixTier(capacity, executor.kv_disk_entries())


def _num_swap_blocks(config: EngineConfig, executor: Executor) -> int:
    per_block = executor.swap_bytes_per_block
    return min(int(config.cache.swap_space * (1 << 30)) // per_block, executor.num_host_blocks) if per_block else 0


def _swap_setup(config: EngineConfig, executor: Executor) -> tuple[HostBlockPool, PreemptionPolicy]:
    """Swap preemption's host pool, sized like the device pool: --swap-space over the executor's
    bytes per block, at most the host blocks it allocated (a sibling engine may ask for fewer)."""
    per_block = executor.swap_bytes_per_block
    num_host = _num_swap_blocks(config, executor)
    if config.scheduler.preemption_mode == "swap" and num_host == 0:
        raise ConfigError(f"--preemption-mode swap: --swap-space {config.cache.swap_space} GiB holds no KV block "
                          f"({per_block} bytes each)")
    return HostBlockPool(num_host), PreemptionPolicy(config.scheduler.preemption_mode, per_block)


class Engine:
    """Synchronous core used by the offline LLM and driven by AsyncEngine's loop thread."""

    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer, max_model_len: int,
                 grammars: Any = None):
        """`grammars`: the structured-output compiler (executor.build_grammar_compiler); by default
        one for `tokenizer` (nothing is imported or compiled until a request asks)."""
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        num_blocks = min(config.cache.num_blocks or executor.num_blocks, executor.num_blocks)
        tier = _host_tier(config, executor)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          tier, _disk_tier(config, executor, tier))
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len,
                                   *_swap_setup(config, executor),
                                   max_loras=config.lora.max_loras if config.lora.enable_lora else None)
        self.vocab_size = executor.vocab_size
        self.output_processor = OutputProcessor(tokenizer, self.scheduler.finish_request)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefill_tokens_total, self.decode_tokens_total, self.num_steps_total = 0, 0, 0  # batch composition
        self.grammars = grammars if grammars is not None else \
            build_grammar_compiler(tokenizer, self.vocab_size, config.grammar_compile_timeout_s,
                                   config.grammar_compile_memory_mb)
        self._compiling: list[Request] = []  # requests whose grammar was not compiled when they arrived
        self.adapters = Adapters(config.lora, executor, self._requests_of_adapter)
        self._step_in_flight = False
        executor.use_grammars(self.grammars.compiled if self.grammars is not None else None)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model, tokenizer and KV cache described by `config` (with tensor parallelism,
        the executor starts or joins the other ranks)."""
        built = build_executor(config)
        try:
            tokenizer = Tokenizer.load(built.source, tuple(built.executor.eos_token_ids))
        except BaseException:
            built.executor.shutdown()
            raise
        return cls(config, built.executor, tokenizer, built.max_model_len)

    def executor_dead(self) -> str | None:
        """A line naming a part of the executor that exited (a tensor-parallel rank), or None."""
        return self.executor.dead()

    def shutdown(self) -> None:
        """Stop the grammar compile workers and the executor (the other tensor-parallel ranks); with a
        disk tier, the device pool's cached blocks are written first, so a restart finds them."""
        if self.grammars is not None:
            self.grammars.shutdown()
        try:
            # a step that did not finish leaves blocks registered whose K/V was never computed: no flush
            if self.block_manager.disk is not None and not self._step_in_flight and self.executor.dead() is None:
                flush = self.block_manager.flush_to_disk()
                self.executor.execute(SchedulerOutput([], [], [], 0, disk=flush))
            elif self.block_manager.disk is not None:
                log.warning("the last step did not finish: the KV pool is not written to the disk tier")
        except Exception:  # noqa: BLE001  (a failed flush loses a cache, never the shutdown)
            log.warning("could not write the KV pool's cached blocks to the disk tier at shutdown", exc_info=True)
        finally:
            self.executor.shutdown()

    # -- requests ------------------------------------------------------------------------
    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """max_tokens as the engine runs it (request_limits.resolve_max_tokens, the one rule)."""
        return resolve_max_tokens(params.max_tokens, num_prompt_tokens, self.max_model_len)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    lora_name: str | None = None) -> Request:
        """Tokenize (if needed), validate against the model, and queue. Raises RequestRejected.
        `lora_name`: a loaded adapter (adapters.add) the request runs through; None: the base model."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params)
        adapter = self.adapters.get(lora_name) if lora_name is not None else None
        if lora_name is not None and adapter is None:
            raise RequestRejected(f"the LoRA adapter {lora_name!r} is not loaded", "model")
        request = Request(request_id, prompt_ids, params, self.resolve_max_tokens(params, len(prompt_ids)),
                          arrival_time if arrival_time is not None else time.monotonic(), priority,
                          self.tokenizer.eos_token_ids, grammar=self._grammar(params), lora_name=lora_name,
                          lora_generation=adapter.generation if adapter is not None else 0)
        self.scheduler.add_request(request)
        if request.grammar_pending:
            self._compiling.append(request)
        self.prompt_tokens_total += len(prompt_ids)
        self.output_processor.add_request(request, prompt if isinstance(prompt, str) else None, output_kind)
        return request

    def _requests_of_adapter(self, name: str) -> int:
        """Unfinished requests that run through the adapter `name` (an unload must wait for them)."""
        return sum(1 for r in self.scheduler.requests.values() if r.lora_name == name)

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject here everything the runner and sampler would trip on: they trust admitted
        requests, and an exception inside step() would kill the engine loop for every request.
        The checks are request_limits' (the server ran them already, for its 400s)."""
        params.validate()  # again: a caller may have changed the fields since construction
        try:
            check_prompt_ids([prompt_ids], self.vocab_size)
        except SamplingParamsError as e:
            raise RequestRejected(str(e), e.param) from None
        check_token_ids(params, self.vocab_size)

    def _grammar(self, params: SamplingParams) -> Any:
        """The compile future of the request's constraint; a constraint known not to compile is
        rejected here (the server has already answered such a request with a 400)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise RequestRejected("structured output is not available on this engine", spec.param)
        future = self.grammars.submit(spec)
        if future.done() and future.exception() is not None:
            error = future.exception()
            raise RequestRejected(str(error), getattr(error, "param", spec.param))
        return future

    def _fail_uncompilable(self) -> list[RequestOutput]:
        """Abort the requests whose grammar failed to compile after they were queued (an offline or
        direct caller that did not wait for the compile); forget those that compiled."""
        failed = [r for r in self._compiling
                  if r.grammar is not None and r.grammar.done() and r.grammar.exception() is not None]
        self._compiling = [r for r in self._compiling
                           if r.grammar is not None and not r.grammar.done() and not r.is_finished]
        outputs = [self.abort(r.request_id) for r in failed]
        return [out for out in outputs if out is not None]

    # -- KV transfer (disaggregated prefill/decode) ----------------------------------------
    def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None) -> KVBlocks:
        """The K/V of the leading full blocks of `token_ids` (under `cache_salt`) that this engine has
        cached (after it ran the prompt), named by their block hashes."""
        blocks = self.block_manager.cached_blocks(token_ids, root_hash(cache_salt))
        size = self.block_manager.block_size
        return KVBlocks(self.executor.kv_layout(), block_hashes(token_ids, size, len(blocks), cache_salt),
                        self.executor.read_kv_blocks(blocks), list(token_ids[:len(blocks) * size]), cache_salt)

    def import_prefix_kv(self, kv: KVBlocks) -> int:
        """Cache here the blocks another engine computed for a prompt's prefix (only those not already
        cached); a request for that prompt then starts from a prefix hit. Returns the number of
        blocks written. Everything is checked before the cache is touched, and the new blocks become
        findable only once all are written: a refused or failed import leaves the cache as it was.
        Raises KVLayoutMismatch (another layout) or ValueError (anything else wrong)."""
        layout = self.executor.kv_layout()
        if kv.layout != layout:
            raise KVLayoutMismatch(f"KV blocks of layout {kv.layout} cannot go into {layout}")
        size, tokens = self.block_manager.block_size, kv.token_ids
        if len(kv.hashes) > len(tokens) // size or len(tokens) > self.max_model_len:
            raise ValueError("the KV blocks cover more tokens than they name (or than the context window)")
        try:
            check_prompt_ids([tokens], self.vocab_size)
        except SamplingParamsError as e:
            raise ValueError(f"the KV blocks' tokens are not this model's: {e}") from None
        if kv.hashes != block_hashes(tokens, size, len(kv.hashes), kv.cache_salt):
            raise ValueError("the KV blocks' hashes are not those of their prompt tokens")
        self.executor.check_kv_blocks(kv.data, len(kv.hashes))
        fill, held = self.block_manager.stage_import(tokens, len(kv.hashes), root_hash(kv.cache_salt))
        try:
            if fill:
                self.executor.write_kv_blocks([b for _, b, _ in fill], kv.data[:, :, [i for i, _, _ in fill]])
        except BaseException:
            self.block_manager.abort_import(held)
            raise
        self.block_manager.commit_import(fill, held)
        return len(fill)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its KV blocks are freed immediately."""
        self.scheduler.finish_request(request_id, FinishReason.ABORT)  # a no-op for unknown ids
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that produced a token or finished."""
        failed = self._fail_uncompilable() if self._compiling else []
        sched = self.scheduler.schedule()
        self._step_in_flight = True  # until the executor has run it (a shutdown then skips the disk flush)
        if not sched.scheduled:
            if sched.finished_ids or sched.preempted_ids or sched.blocks_to_swap_out or sched.disk:  # copy out...
                self.block_manager.settle_disk(self.executor.execute(sched).kv_disk_lost)
            self._step_in_flight = False
            pending = [r.grammar for r in self._compiling if r.grammar is not None]
            if pending:  # idle until a grammar is ready instead of spinning
                wait(pending, timeout=0.05, return_when=FIRST_COMPLETED)
            return failed
        scored = self._count_batch(sched)
        started = time.perf_counter()
        result = self.executor.execute(sched)
        self._step_in_flight = False
        self.scheduler.observe_step(sched.num_batched_tokens, time.perf_counter() - started, scored)
        self.block_manager.settle_disk(result.kv_disk_lost)
        updated = self.scheduler.update(sched, result.sampled, result.accepted, result.draft_token_ids)
        self.generation_tokens_total += sum(r.num_new_tokens for r in updated if r.max_tokens > 0)  # 0: no token
        return failed + self.output_processor.process(updated, result.logprobs,
                                                      prompt_logprobs=result.prompt_logprobs,
                                                      pooled=result.pooled,
                                                      accepted_logprobs=result.accepted_logprobs)

    def _count_batch(self, sched: SchedulerOutput) -> int:
        """Prefill vs decode tokens of this step (a decode row: one token past the prompt, plus its draft).
        Returns the step's prompt tokens that also go through the LM head for prompt_logprobs."""
        scored = 0
        for s in sched.scheduled:
            request = self.scheduler.requests.get(s.request_id)
            decode = (len(s.token_ids) == 1 + len(s.draft_token_ids) and request is not None
                      and s.num_computed_tokens >= request.num_prompt_tokens)
            if decode:
                self.decode_tokens_total += len(s.token_ids)
            else:
                self.prefill_tokens_total += len(s.token_ids)
            if request is not None and request.sampling_params.prompt_logprobs is not None:
                scored += max(0, min(len(s.token_ids), request.num_prompt_tokens - s.num_computed_tokens))
        self.num_steps_total += 1
        return scored

    def stats(self) -> LoadReport:
        s, waiting, running = self.scheduler.stats(), self.scheduler.waiting, self.scheduler.running
        return LoadReport(
            num_waiting=s.num_waiting, num_running=s.num_running,
            num_waiting_prompt_tokens=sum(_prefill_left(r) for r in waiting),
            num_waiting_cached_tokens=sum(r.num_tokens - r.num_computed_tokens - _prefill_left(r) for r in waiting),
            kv_blocks_used=self.block_manager.num_blocks - self.block_manager.num_free_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            num_waiting_output_tokens=sum(_output_left(r) for r in waiting),
            num_running_output_tokens=sum(_output_left(r) for r in running),
            num_waiting_certain_output_tokens=sum(_certain_output_left(r) for r in waiting),
            num_running_certain_output_tokens=sum(_certain_output_left(r) for r in running),
            max_num_seqs=self.config.scheduler.max_num_seqs,
            prefill_tokens_total=self.prefill_tokens_total, decode_tokens_total=self.decode_tokens_total,
            num_steps_total=self.num_steps_total,
            spec_decode_num_drafts=s.spec.num_drafts, spec_decode_num_draft_tokens=s.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(s.spec.accepted_per_pos),
            num_swapped=s.num_swapped, num_swapped_out=s.num_swapped_out, num_swapped_in=s.num_swapped_in,
            num_swap_fallbacks=s.num_swap_fallbacks, lora_adapters=sorted(a.name for a in self.adapters.list()),
            running_lora_adapters=_adapter_names(running), waiting_lora_adapters=_adapter_names(waiting),
            max_lora=self.config.lora.max_loras if self.config.lora.enable_lora else 0,
            **self._tier_stats())

    def _tier_stats(self) -> dict[str, Any]:
        tier = self.block_manager.tier
        if tier is None:
            return {}
        return {"kv_offload_hit_tokens": self.scheduler.tier_hit_tokens, "kv_offload_blocks_out": tier.blocks_out,
                "kv_offload_blocks_in": tier.blocks_in, "kv_offload_blocks_used": tier.num_used,
                "kv_offload_blocks_total": tier.num_blocks, **self._disk_stats()}

    def _disk_stats(self) -> dict[str, Any]:
        disk = self.block_manager.disk
        if disk is None:
            return {}
        files = self.executor.kv_disk_stats()
        return {"kv_offload_disk_hit_tokens": disk.blocks_loaded * self.block_manager.block_size,
                "kv_offload_disk_blocks_written": disk.blocks_written, "kv_offload_disk_blocks_read": disk.blocks_read,
                "kv_offload_disk_blocks_lost": disk.blocks_lost, "kv_offload_disk_blocks_used": disk.num_used,
                "kv_offload_disk_blocks_total": disk.capacity, "kv_offload_disk_bytes_written": files["bytes_written"],
                "kv_offload_disk_bytes_read": files["bytes_read"],
                "kv_offload_disk_read_seconds": files["read_seconds"]}
