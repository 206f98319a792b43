"""Engine logprobs ({token_id: logprob} per token, chosen first) → OpenAI's chat and completion shapes."""

from __future__ import annotations

import math

from ferrylm.http.protocol import ChatLogprobs, CompletionLogprobs, PromptLogprobEntry, TokenLogprob, TopLogprob
from ferrylm.outputs import PromptLogprobs
from ferrylm.tokenizer import Tokenizer


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_text(token_id)


# vLLM's floor: JSON has no -inf or NaN (the encoder raises, or pydantic writes null), so a
# banned token's logprob (-inf) or a degenerate NaN is sent as this finite "impossible" value.
_MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    """The logprob as a JSON-safe float in [-9999, 0]: NaN and -inf become -9999, +inf 0."""
    if math.isnan(logprob):
        return _MIN_LOGPROB
    return min(max(float(logprob), _MIN_LOGPROB), 0.0)


def _top(entries: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens (the chosen one is first in `entries` but need not be among them).

    Values are made finite first so a NaN cannot scramble the sort.
    """
    return sorted(((tid, _finite(lp)) for tid, lp in entries.items()), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  k: int) -> ChatLogprobs:
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        tops = [TopLogprob(token=(t := _token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode()))
                for tid, lp in _top(entries, k)]
        content.append(TokenLogprob(token=text, logprob=_finite(entries[token_id]), bytes=list(text.encode()),
                                    top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                        offset: int) -> CompletionLogprobs:
    """`offset` is where the first token's text starts in the choice's text (for `text_offset`)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(entries[token_id]))
        result.top_logprobs.append({_token_text(tokenizer, tid): lp for tid, lp in _top(entries, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echoed_prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], prompt_logprobs: PromptLogprobs, k: int,
                           generated: CompletionLogprobs) -> CompletionLogprobs:
    """OpenAI's echo + logprobs: the prompt's tokens (the first with null logprob and top_logprobs,
    text offsets from 0), then the generated ones' (`generated`, offsets after the echoed text)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for token_id, entries in zip(prompt_ids, prompt_logprobs):
        text = _token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if entries is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(entries[token_id].logprob))
        top = _top({tid: lp.logprob for tid, lp in entries.items()}, k)
        result.top_logprobs.append({_token_text(tokenizer, tid): lp for tid, lp in top})
    result.tokens += generated.tokens
    result.token_logprobs += generated.token_logprobs
    result.top_logprobs += generated.top_logprobs
    result.text_offset += generated.text_offset
    return result


def vllm_prompt_logprobs(prompt_ids: list[int], prompt_logprobs: PromptLogprobs,
                         k: int) -> list[dict[str, PromptLogprobEntry] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} holding the prompt's token and the top k."""
    out: list[dict[str, PromptLogprobEntry] | None] = []
    for token_id, entries in zip(prompt_ids, prompt_logprobs):
        if entries is None:
            out.append(None)
            continue
        keep = {token_id} | {tid for tid, _ in _top({tid: lp.logprob for tid, lp in entries.items()}, k)}
        out.append({str(tid): PromptLogprobEntry(logprob=_finite(lp.logprob), rank=lp.rank,
                                                 decoded_token=lp.decoded_token)
                    for tid, lp in entries.items() if tid in keep})
    return out
