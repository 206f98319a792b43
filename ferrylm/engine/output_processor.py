"""OutputProcessor: turns the tokens a step appended into RequestOutputs (detokenize, stop strings,
logprobs, cumulative or delta shaping), so that Engine.step() only schedules, runs and updates.

It keeps the per-request *output* state (detokenizer, text so far, unsent logprobs); the
scheduler stays the only owner of a request's life: a stop string found in the text is reported
through `finish_request` (the scheduler's), never by setting the request's status here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrylm.detokenizer import IncrementalDetokenizer
from ferrylm.engine.request import Request
from ferrylm.executor import PromptLogprob, TokenLogprobs
from ferrylm.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)

if TYPE_CHECKING:
    from ferrylm.tokenizer import Tokenizer

FinishRequest = Callable[[str, FinishReason, str | int | None], None]  # Scheduler.finish_request


@dataclass
class _RequestState:
    """One request's output so far: what a CUMULATIVE output repeats, or a DELTA one has not sent."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    output_kind: RequestOutputKind
    logprobs: list[dict[int, float]] | None  # None: not asked for; DELTA keeps only the unsent ones
    text: str = ""  # CUMULATIVE only
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs | None = None  # [None] + one entry per scored position, when asked
    prompt_logprobs_sent: bool = False  # DELTA sends them once
    pooled: list[float] | None = None  # --runner pooling: the vector, once the prompt is done

    def add_prompt_logprobs(self, scored: Sequence[PromptLogprob], decode: Callable[[int], str]) -> None:
        """Append the next positions in order; a position seen before (a preempted request computes
        its prompt again) is skipped."""
        if self.prompt_logprobs is None:
            return
        for item in scored:
            if item.position != len(self.prompt_logprobs):
                continue
            target = next(iter(item.entries))
            top = sorted(((tid, lp) for tid, lp in item.entries.items()), key=lambda e: -e[1])
            ranks = {tid: i + 1 for i, (tid, _) in enumerate(top)}
            ranks[target] = item.rank
            self.prompt_logprobs.append({tid: Logprob(lp, ranks[tid], decode(tid)) for tid, lp in item.entries.items()})

    def _prompt_logprobs_out(self) -> PromptLogprobs | None:
        complete = self.prompt_logprobs is not None and len(self.prompt_logprobs) >= len(self.request.prompt_token_ids)
        if not complete or (self.output_kind is RequestOutputKind.DELTA and self.prompt_logprobs_sent):
            return None
        self.prompt_logprobs_sent = True
        return list(self.prompt_logprobs or [])

    def add_logprobs(self, sampled: TokenLogprobs | None, token: int) -> None:
        if self.logprobs is not None and sampled is not None:
            self.logprobs.append(sampled.entries)
            self.cumulative_logprob += sampled.entries[token]

    def output(self, text_delta: str, token_delta: list[int]) -> RequestOutput:
        """This step's RequestOutput; copies, since a consumer may read it on another thread."""
        req = self.request
        wants_logprobs = self.logprobs is not None
        if self.output_kind is RequestOutputKind.DELTA:
            text, token_ids, logprobs = text_delta, list(token_delta), self.logprobs
            if wants_logprobs:
                self.logprobs = []  # sent: no history kept that the consumer already has
        else:
            self.text += text_delta
            text, token_ids = self.text, req.output_token_ids
            logprobs = None if self.logprobs is None else list(self.logprobs)
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=logprobs, cumulative_logprob=self.cumulative_logprob if wants_logprobs else None,
            text_delta=text_delta, token_ids_delta=list(token_delta))
        return RequestOutput(req.request_id, self.prompt, req.prompt_token_ids, [completion], req.is_finished,
                             req.num_cached_tokens, dataclasses.replace(req.metrics), self._prompt_logprobs_out(),
                             self.pooled)


def _stamp(metrics: RequestMetrics, now: float, finished: bool, token: bool = True) -> None:
    """Token times are taken when a token becomes output, which is what TTFT and ITL measure."""
    if token:
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
    if finished and metrics.finished_time is None:
        metrics.finished_time = now


class OutputProcessor:
    """Per-request output state, from add_request until the request's final output."""

    def __init__(self, tokenizer: Tokenizer, finish_request: FinishRequest):
        """`tokenizer.hf` is what the detokenizers decode with (read per request, so an engine
        built without a tokenizer still validates requests); `finish_request`: the scheduler's,
        called when a stop string ends a request."""
        self._tokenizer = tokenizer
        self._finish_request = finish_request
        self._states: dict[str, _RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def add_request(self, request: Request, prompt: str | None,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Start tracking `request` (already queued in the scheduler); `prompt` is its text, if any."""
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            self._tokenizer.hf, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self._states[request.request_id] = _RequestState(
            request, prompt, detokenizer, output_kind, [] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def process(self, requests: Sequence[Request], logprobs: Mapping[str, TokenLogprobs],
                now: float | None = None,
                prompt_logprobs: Mapping[str, Sequence[PromptLogprob]] | None = None,
                accepted_logprobs: Mapping[str, Sequence[TokenLogprobs]] | None = None,
                pooled: Mapping[str, list[float]] | None = None) -> list[RequestOutput]:
        """One output per request that received a token this step, or ended with none (max_tokens 0):
        scheduler.update's list. `prompt_logprobs`: the prompt tokens the step scored, per request.
        `accepted_logprobs`: those of the speculative draft tokens emitted before the sampled one."""
        now = time.monotonic() if now is None else now
        for rid, scored in (prompt_logprobs or {}).items():
            if rid in self._states:
                self._states[rid].add_prompt_logprobs(scored, self._token_text)
        for rid, vector in (pooled or {}).items():
            if rid in self._states:
                self._states[rid].pooled = vector
        outputs = []
        for req in requests:
            state = self._states[req.request_id]
            if req.max_tokens == 0:  # the prompt only: ends with no token
                _stamp(req.metrics, now, True, token=False)
                outputs.append(state.output("", []))
                del self._states[req.request_id]
                continue
            new = req.token_ids[len(req.token_ids) - max(req.num_new_tokens, 1):]
            text, emitted = "", []
            drafted = list((accepted_logprobs or {}).get(req.request_id, ()))
            for i, token in enumerate(new):  # several when a speculative draft was accepted
                state.add_logprobs(drafted[i] if i < len(drafted) else logprobs.get(req.request_id), token)
                emitted.append(token)
                text += self._detokenize(state, token, last=i == len(new) - 1)
                if len(emitted) < len(new) and req.is_finished and req.finish_reason is FinishReason.STOP \
                        and isinstance(req.stop_reason, str):
                    # a stop string ended it mid-draft: the tokens after it were never generated
                    del req.token_ids[len(req.token_ids) - (len(new) - len(emitted)):]
                    break
            _stamp(req.metrics, now, req.is_finished)
            outputs.append(state.output(text, emitted))
            if req.is_finished:
                del self._states[req.request_id]
        return outputs

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.token_text(token_id)

    def _detokenize(self, state: _RequestState, token: int, last: bool = True) -> str:
        """The text `token` adds; a stop string it completes finishes the request (via the scheduler).

        `last`: the step's last new token. An earlier one (an accepted draft token) that completes a
        stop string ends the request there even if the scheduler finished it at a later token (EOS,
        length): that later token was never generated, so the stop string is the reason."""
        req = state.request
        started = time.perf_counter()
        delta = state.detokenizer.add_tokens([token])
        req.metrics.detokenize_time += time.perf_counter() - started
        if delta.stop_reason is not None and not req.is_finished:
            self._finish_request(req.request_id, FinishReason.STOP, delta.stop_reason)
            return delta.text
        if delta.stop_reason is not None and not last:
            req.finish_reason, req.stop_reason = FinishReason.STOP, delta.stop_reason  # already freed
            return delta.text
        if req.is_finished and last:
            return delta.text + state.detokenizer.flush()
        return delta.text

    def abort(self, request_id: str, now: float | None = None) -> RequestOutput | None:
        """Drop a request's state; its final output (nothing new) once the scheduler finished it."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        _stamp(state.request.metrics, time.monotonic() if now is None else now, True, token=False)
        return state.output("", [])
