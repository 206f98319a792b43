"""SamplingParams: what a request asks of the sampler and of the stop logic (vLLM-compatible names)."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling parameter a user sent is out of range; the server maps it to a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(value: object) -> None:
    """SamplingParamsError unless `value` is None or a non-empty string of at most MAX_CACHE_SALT_CHARS
    (the one rule for the body field, the gateway's forwarding and the KV export route)."""
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= MAX_CACHE_SALT_CHARS):
        raise SamplingParamsError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                  "characters", "cache_salt")
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one constraint the output must satisfy (a JSON schema, a
    regex, one of `choice`, an EBNF grammar, or any JSON object). Pure data: model/structured/structured_output.py
    compiles it (xgrammar) and masks the logits with it.

    `disable_any_whitespace` (vLLM's name) defaults to True here: JSON is generated compact, so a small
    model cannot spend its max_tokens on whitespace; False lets the grammar accept any whitespace.
    `param` is the request field it came from, for a 400 naming it when it does not compile."""

    json: str | None = None  # a JSON schema, serialised (a dict is accepted and serialised here)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like)
    json_object: bool = False
    disable_any_whitespace: bool = True
    param: str = "structured_outputs"
    # Under a reasoning parser: the constraint starts after the output's thinking closes with these
    # tokens (`</think>`'s), and `reasoning_start` (`<think>`, one token) may open it at the first
    # position instead of the answer (model/structured/reasoning_gate.py). Empty: from the first token.
    reasoning_end: tuple[int, ...] = ()
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))  # key order kept: it is the output order
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs needs exactly one of json, regex, choice, grammar or "
                                      f"json_object (got {', '.join(given) or 'none'})", self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError("structured_outputs.choice must be a non-empty list of strings", self.param)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty string", self.param)

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[Any, ...]:
        """What the compiled grammar depends on: the compile cache's key (not `param`)."""
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)

    def ref(self) -> str:
        """The compiled grammar's reference, a plain string a SchedulerOutput carries to the runner
        (GrammarCompiler.compiled resolves it on the sampling rank)."""
        return hashlib.sha256(repr(self.key()).encode()).hexdigest()


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
    # vLLM's prompt_logprobs: per prompt token (the first has none) its logprob, its rank and the top
    # `prompt_logprobs` alternatives, from the prefill's own forward pass; skips the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # the output is constrained to a grammar
    # vLLM's cache_salt: part of the prompt's prefix-cache block hashes, so only requests under the same
    # salt share cached blocks (the front doors set it per tenant); it changes no output
    cache_salt: str | None = None
    # --runner pooling (vLLM's PoolingParams, folded in): the prompt's final hidden states pooled into one
    # vector (last | mean | cls token), L2-normalised when `normalize`; such a request generates nothing
    pooling: str | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            # keys stay unchecked objects until validate() (which names a bad one)
            self.logit_bias = {_token_key(token): bias for token, bias in self.logit_bias.items()}  # type: ignore[misc]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise SamplingParamsError naming the field for any out-of-range value.

        Types and finiteness come first: the range checks below compare, and NaN fails every
        comparison while inf passes the one-sided ones (json.loads accepts both from a client).
        """
        self._validate_types()
        checks = [
            (self.n >= 1, "n must be at least 1", "n"),
            (self.temperature >= 0.0, "temperature must be non-negative", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (self.top_k is None or self.top_k >= 1, "top_k must be at least 1 (or unset)", "top_k"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", "presence_penalty"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", "frequency_penalty"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be positive", "repetition_penalty"),
            # 0: the prompt only (prefill, prompt logprobs, no token), as OpenAI's legacy echo requests
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be non-negative", "max_tokens"),
            (self.min_tokens >= 0, "min_tokens must be non-negative", "min_tokens"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must not exceed max_tokens", "min_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]", "logprobs"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]",
             "prompt_logprobs"),
        ]
        checks += [(self.pooling in POOLING_TYPES, f"pooling must be one of {', '.join(map(str, POOLING_TYPES))}",
                    "pooling"),
                   (self.pooling is None or self.max_tokens == 0, "a pooling request generates nothing: max_tokens "
                    "must be 0", "max_tokens")]
        for ok, message, param in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        check_cache_salt(self.cache_salt)
        if self.structured_outputs is not None:
            # the grammar allows only EOS once complete: min_tokens or ignore_eos would leave no token
            for name, neutral in (("min_tokens", 0), ("ignore_eos", False)):
                if getattr(self, name) != neutral:
                    raise SamplingParamsError(f"{name} cannot be combined with structured output (the grammar "
                                              "ends the output with EOS once it is complete)", name)
        for token_id, bias in (self.logit_bias or {}).items():
            if not -100.0 <= float(bias) <= 100.0:
                raise SamplingParamsError(f"logit_bias for token {token_id} must be in [-100, 100]", "logit_bias")

    def _validate_types(self) -> None:
        """Numbers where numbers are due, so the sampler never meets a str, a float id or a NaN."""
        for name in _FLOAT_FIELDS:
            if not _is_finite(getattr(self, name)):
                raise SamplingParamsError(f"{name} must be a finite number", name)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, numbers.Integral):
                raise SamplingParamsError(f"{name} must be an integer", name)
        if not isinstance(self.logit_bias, (dict, type(None))):
            raise SamplingParamsError("logit_bias must map token ids to numbers", "logit_bias")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, numbers.Integral) or not _is_finite(bias):
                raise SamplingParamsError(f"logit_bias for token {token_id!r} must be a finite number keyed "
                                          "by an integer token id", "logit_bias")
        if not all(isinstance(t, numbers.Integral) for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids must be integers", "stop_token_ids")


POOLING_TYPES = (None, "last", "mean", "cls")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


def _is_finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def _token_key(token: object) -> object:
    """OpenAI sends logit_bias keys as strings ("50256"); anything else is left for validate()."""
    if isinstance(token, str):
        try:
            return int(token)
        except ValueError:
            raise SamplingParamsError(f"logit_bias key {token!r} is not a token id", "logit_bias") from None
    return token
