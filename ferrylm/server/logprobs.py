"""Engine logprobs ({token_id: logprob} per token, chosen first) → OpenAI's chat and completion shapes."""

from __future__ import annotations

from ferrylm.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from ferrylm.tokenizer import Tokenizer


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entries: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens (the chosen one is first in `entries` but need not be among them)."""
    return sorted(entries.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  k: int) -> ChatLogprobs:
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        tops = [TopLogprob(token=(t := _token_text(tokenizer, tid)), logprob=lp, bytes=list(t.encode()))
                for tid, lp in _top(entries, k)]
        content.append(TokenLogprob(token=text, logprob=entries[token_id], bytes=list(text.encode()),
                                    top_logprobs=tops))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int,
                        offset: int) -> CompletionLogprobs:
    """`offset` is where the first token's text starts in the choice's text (for `text_offset`)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, entries in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(entries[token_id])
        result.top_logprobs.append({_token_text(tokenizer, tid): lp for tid, lp in _top(entries, k)})
        result.text_offset.append(offset)
        offset += len(text)
    return result
