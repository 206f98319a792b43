"""Results handed back to callers (vLLM-compatible shapes): RequestOutput, CompletionOutput, Usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(str, Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = "cumulative"  # text, token_ids, logprobs: everything so far (the offline API)
    DELTA = "delta"  # text, token_ids, logprobs: only what this step added (streaming servers:
    # a consumer that falls behind then holds O(tokens) of backlog, not O(tokens²) of copies)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or the server


@dataclass
class CompletionOutput:
    """One sampled sequence. `text`/`token_ids`/`logprobs` are cumulative, or with
    RequestOutputKind.DELTA only this step's; `*_delta` are always what this step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}, chosen token first
    cumulative_logprob: float | None = None
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a prompt position's logprobs (vLLM's Logprob): rank 1 is the likeliest."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, {token_id: Logprob} (the prompt's token first, then the top alternatives); the
# first prompt token has no context, so None (vLLM's RequestOutput.prompt_logprobs).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request's life, for TTFT / ITL / queue-time metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    detokenize_time: float = 0.0  # seconds the output processor spent detokenizing (the trace's decode span)
    # speculative decoding: steps that verified a draft, draft tokens proposed, and of those accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens per verifying step (accepted drafts + the target's own), vLLM's mean acceptance length."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass
class RequestOutput:
    """State of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None  # when asked (SamplingParams.prompt_logprobs), once complete
    pooled: list[float] | None = None  # SamplingParams.pooling: the prompt's vector, in the finished output


@dataclass(frozen=True)
class Usage:
    """What a request costs, the one billing rule of every front door: each prompt counts once
    (not once per sample, as OpenAI's usage reports it) plus every generated token."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache (not recomputed)

    @classmethod
    def of(cls, prompt_lens: list[int], completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(sum(prompt_lens), completion_tokens, cached_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
