"""SamplingParams: what a request asks of the sampler and of the stop logic (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling parameter a user sent is out of range; the server maps it to a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request sampling and stopping options.

    temperature 0 means greedy. `None` means "not set" everywhere (never -1).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise SamplingParamsError naming the field for any out-of-range value."""
        checks = [
            (self.n >= 1, "n must be at least 1", "n"),
            (self.temperature >= 0.0, "temperature must be non-negative", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (self.top_k is None or self.top_k >= 1, "top_k must be at least 1 (or unset)", "top_k"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be positive", "repetition_penalty"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens"),
            (self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens", "min_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]", "logprobs"),
        ]
        for ok, message, param in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100.0 <= float(bias) <= 100.0:
                raise SamplingParamsError(f"logit_bias for token {token_id} must be in [-100, 100]", "logit_bias")
