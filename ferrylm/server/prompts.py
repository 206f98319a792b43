"""Request → prompt token ids without stalling other clients: a free size bound first (a prompt
that cannot fit the context window is refused before it is tokenized), then the chat template and
the tokenizer in a worker thread, so a 4 MB message never blocks the event loop."""

from __future__ import annotations

import asyncio
import math

from ferrylm.http import prompt_ids
from ferrylm.http.errors import APIError, invalid
from ferrylm.http.protocol import ChatCompletionRequest, CompletionRequest
from ferrylm.tokenizer import Tokenizer


def completion_prompt_count(request: CompletionRequest) -> int:
    """How many prompts `prompt` holds (text, texts, token ids, or lists of token ids)."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return 1
    return len(prompt)


def check_num_sequences(num_prompts: int, n: int, limit: int) -> None:
    """prompts × n engine requests per API request at most (`--max-sequences-per-request`)."""
    if num_prompts * n > limit:
        param = "n" if num_prompts == 1 else "prompt"
        raise invalid(f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                      f"the limit per request is {limit}.", param, "too_many_sequences")


def _check_length_bound(num_chars: int, tokenizer: Tokenizer, max_model_len: int, what: str) -> None:
    at_least = math.ceil(num_chars / tokenizer.max_token_chars)
    if at_least >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"{what} would result in at least {at_least} tokens. Please reduce the length of "
                            f"the {what}.", what, "context_length_exceeded")


async def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest, max_model_len: int) -> list[int]:
    _check_length_bound(sum(len(m.text()) for m in request.messages), tokenizer, max_model_len, "messages")
    return await asyncio.to_thread(prompt_ids.chat_prompt_ids, tokenizer, request)


async def completion_prompt_ids(tokenizer: Tokenizer, request: CompletionRequest, vocab_size: int,
                                max_model_len: int) -> list[list[int]]:
    texts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    longest = max((len(t) for t in texts if isinstance(t, str)), default=0)
    _check_length_bound(longest, tokenizer, max_model_len, "prompt")
    return await asyncio.to_thread(prompt_ids.completion_prompt_ids, tokenizer, request, vocab_size)
