"""How many tokens a request reserves against its tenant's limits at admission: what the engine
may really produce, not a guess. One pure function, so `ferrylm serve` (which knows its own
context window) and `ferrylm gateway` (which learns the replicas' from /load) reserve alike; a
tenant must not get more through the gateway than the server alone would let it have."""

from __future__ import annotations

from typing import NamedTuple

from ferrylm.request_limits import resolve_max_tokens


class ReservedTokens(NamedTuple):
    prompt_tokens: int  # every prompt, once per choice
    output_tokens: int  # the most every choice of every prompt may generate


def reserved_tokens(prompt_lens: list[int], n: int, max_tokens: int | None, max_model_len: int | None,
                    fallback_max_tokens: int | None = None) -> ReservedTokens:
    """Prompt and output tokens to reserve for `n` choices of each prompt.

    With `max_tokens` each choice may generate that many. Without it the engine runs each choice
    to the end of the context window (request_limits.resolve_max_tokens, the engine's own rule),
    so that is reserved. `fallback_max_tokens` stands in only
    when the context window is not known yet (a gateway before its first /load answer)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    per_prompt: list[int] = []
    for length in prompt_lens:
        if max_tokens is not None or max_model_len is not None:
            per_prompt.append(resolve_max_tokens(max_tokens, length, max_model_len or 0))
        elif fallback_max_tokens is not None:
            per_prompt.append(fallback_max_tokens)
        else:
            raise ValueError("without max_tokens the reservation needs max_model_len or a fallback")
    return ReservedTokens(sum(prompt_lens) * n, sum(per_prompt) * n)
