"""The rules every front door and the engine share about what a request may ask for, each decided
in exactly one place: how many tokens it may generate without max_tokens, whether it fits the
context window, and whether the token ids it names exist. The server checks them before any
engine work (a 400 naming the field), the engine checks them again at its boundary (so the core
can trust an admitted request), and the gateways reserve by the same numbers."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from ferrylm.sampling_params import SamplingParams, SamplingParamsError


class ContextLengthExceeded(SamplingParamsError):
    """The prompt, or prompt + max_tokens, does not fit the context window (OpenAI's wording)."""

    code = "context_length_exceeded"


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """max_tokens as the engine runs it: the client's (0: the prompt only, no token), or the rest of
    the context window (at least 1)."""
    if max_tokens is not None:
        return max(max_tokens, 0)
    return max(max_model_len - num_prompt_tokens, 1)


def check_context_window(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         what: str = "prompt") -> None:
    """Raise ContextLengthExceeded unless the prompt leaves room for max_tokens (or one token)."""
    n = num_prompt_tokens
    if n >= max_model_len:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                    f"{what} resulted in {n} tokens. Please reduce the length of the {what}.", what)
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ContextLengthExceeded(f"This model's maximum context length is {max_model_len} tokens. However, you "
                                    f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the "
                                    "completion). Please reduce the length of the messages or completion.",
                                    "max_tokens")


def _first_outside(ids: Iterable[object], vocab_size: int) -> object | None:
    return next((t for t in ids if not isinstance(t, numbers.Integral) or not 0 <= int(t) < vocab_size), None)


def check_prompt_ids(prompts: Iterable[list[int]], vocab_size: int, param: str = "prompt") -> None:
    """Raise SamplingParamsError(param) for a prompt token id outside the vocabulary."""
    for prompt in prompts:
        bad = _first_outside(prompt, vocab_size)
        if bad is not None:
            raise SamplingParamsError(f"Token id {bad!r} in the {param} is outside the vocabulary "
                                      f"(size {vocab_size}).", param)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise SamplingParamsError naming the field for a logit_bias or stop_token_ids id outside
    the vocabulary."""
    for param, ids in (("logit_bias", list(params.logit_bias or {})), ("stop_token_ids", params.stop_token_ids)):
        bad = _first_outside(ids, vocab_size)
        if bad is not None:
            raise SamplingParamsError(f"Token id {bad!r} in {param} is outside the vocabulary (size {vocab_size}).",
                                      param)
