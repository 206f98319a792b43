"""Engine: add_request / abort / step(). One step = schedule → run the model → update → detokenize."""

from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass

from ferrylm.config import EngineConfig
from ferrylm.detokenizer import IncrementalDetokenizer
from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.request import Request
from ferrylm.engine.scheduler import RequestRejected, Scheduler
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics, readiness and admission control."""

    num_waiting: int
    num_running: int
    num_waiting_prompt_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Output tokens the requests may still generate (max_tokens minus generated): admission control
    # scales these by the fraction of max_tokens requests really use.
    num_waiting_output_tokens: int = 0
    num_running_output_tokens: int = 0
    max_num_seqs: int | None = None
    # The part of those that will surely be generated (ignore_eos, min_tokens): not scaled down.
    num_waiting_certain_output_tokens: int = 0
    num_running_certain_output_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def _output_left(request: Request) -> int:
    return max(0, request.max_tokens - request.num_output_tokens)


def _certain_output_left(request: Request) -> int:
    """Output tokens that will be generated whatever the model says (ignore_eos, min_tokens)."""
    if request.sampling_params.ignore_eos:
        return _output_left(request)
    return min(_output_left(request), max(0, request.sampling_params.min_tokens - request.num_output_tokens))


@dataclass
class _Tracked:
    """Per-request output state kept by the engine (text so far, logprobs)."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


class Engine:
    """Synchronous core used by the offline LLM and driven by AsyncEngine's loop thread."""

    def __init__(self, config: EngineConfig, runner, tokenizer: Tokenizer, max_model_len: int):
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        num_blocks = min(config.cache.num_blocks or runner.num_blocks, runner.num_blocks)
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, max_model_len)
        self.vocab_size = runner.config.vocab_size
        self._tracked: dict[str, _Tracked] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        """Load the model, tokenizer and KV cache described by `config`."""
        from ferrylm.model.device import resolve_device, resolve_dtype
        from ferrylm.model.loader import Checkpoint
        from ferrylm.model.model_source import resolve_model
        from ferrylm.model.runner import ModelRunner

        source = resolve_model(config.model)
        checkpoint = Checkpoint(source)
        max_model_len = config.scheduler.max_model_len or checkpoint.config.max_position_embeddings
        device = resolve_device(config.device)
        runner = ModelRunner(checkpoint, config.cache, resolve_dtype(config.dtype, device), device, max_model_len,
                             config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
        tokenizer = Tokenizer.load(source, checkpoint.config.eos_token_ids)
        return cls(config, runner, tokenizer, max_model_len)

    # -- requests ------------------------------------------------------------------------
    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """max_tokens as the engine runs it: the client's, or the rest of the context window."""
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt_tokens
        return max(max_tokens, 1)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> Request:
        """Tokenize (if needed), validate against the model, and queue. Raises RequestRejected."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params)
        request = Request(request_id, prompt_ids, params, self.resolve_max_tokens(params, len(prompt_ids)),
                          arrival_time if arrival_time is not None else time.monotonic(), priority,
                          self.tokenizer.eos_token_ids)
        self.scheduler.add_request(request)
        self.prompt_tokens_total += len(prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer.hf, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                       stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self._tracked[request_id] = _Tracked(request, prompt if isinstance(prompt, str) else None, detok,
                                             logprobs=[] if params.logprobs is not None else None,
                                             output_kind=output_kind)
        return request

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject here everything the runner and sampler would trip on: they trust admitted
        requests, and an exception inside step() would kill the engine loop for every request."""
        params.validate()  # again: a caller may have changed the fields since construction
        bad = [t for t in prompt_ids if not isinstance(t, numbers.Integral) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]!r} is outside the vocabulary (size {self.vocab_size})",
                                  "prompt")
        for param, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            for token_id in ids:
                if not 0 <= int(token_id) < self.vocab_size:
                    raise SamplingParamsError(
                        f"token id {token_id} in {param} is outside the vocabulary (size {self.vocab_size})", param)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; its KV blocks are freed immediately."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish_request(request_id, FinishReason.ABORT)
        return self._output(tracked, "", [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return outputs of requests that produced a token or finished."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        result = self.runner.execute(sched)
        updated = self.scheduler.update(sched, result.sampled)
        now = time.monotonic()
        outputs = []
        for req in updated:
            self.generation_tokens_total += 1
            tracked = self._tracked[req.request_id]
            token = req.token_ids[-1]
            self._record_metrics(req, now)
            if tracked.logprobs is not None and req.request_id in result.logprobs:
                entries = result.logprobs[req.request_id].entries
                tracked.logprobs.append(entries)
                tracked.cumulative_logprob += entries[token]
            delta = tracked.detokenizer.add_tokens([token])
            text = delta.text
            if delta.stop_reason is not None and not req.is_finished:
                self.scheduler.finish_request(req.request_id, FinishReason.STOP, delta.stop_reason)
            elif req.is_finished:
                text += tracked.detokenizer.flush()
            outputs.append(self._output(tracked, text, [token]))
            if req.is_finished:
                del self._tracked[req.request_id]
        return outputs

    @staticmethod
    def _record_metrics(req: Request, now: float) -> None:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.is_finished:
            req.metrics.finished_time = now

    def _output(self, tracked: _Tracked, text_delta: str, token_delta: list[int]) -> RequestOutput:
        req = tracked.request
        logprobs = tracked.logprobs
        if tracked.output_kind is RequestOutputKind.DELTA:
            text, token_ids = text_delta, list(token_delta)
            logprobs = None if logprobs is None else logprobs[len(logprobs) - len(token_delta):]
            if logprobs is not None:
                tracked.logprobs = []  # sent: the engine keeps no history a consumer already has
        else:
            tracked.text += text_delta
            text, token_ids = tracked.text, req.output_token_ids
            logprobs = None if logprobs is None else list(logprobs)
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=logprobs,
            cumulative_logprob=tracked.cumulative_logprob if tracked.logprobs is not None else None,
            text_delta=text_delta, token_ids_delta=token_delta)
        # Copies: the consumer may read these on another thread while the engine keeps stepping.
        return RequestOutput(req.request_id, tracked.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             req.num_cached_tokens, dataclasses.replace(req.metrics))

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        return EngineStats(s.num_waiting, s.num_running, waiting_tokens, used, self.block_manager.num_blocks,
                           s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions,
                           self.prompt_tokens_total, self.generation_tokens_total,
                           sum(_output_left(r) for r in self.scheduler.waiting),
                           sum(_output_left(r) for r in self.scheduler.running),
                           self.config.scheduler.max_num_seqs,
                           sum(_certain_output_left(r) for r in self.scheduler.waiting),
                           sum(_certain_output_left(r) for r in self.scheduler.running))
