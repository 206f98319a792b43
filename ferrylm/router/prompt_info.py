"""What the router needs to know about a prompt before routing it: its token count (for rate
limits and outstanding-token accounting) and the engine's prefix-cache block hashes (for prefix
affinity). Exact when the group's tokenizer is loaded, estimated from the text otherwise."""

from __future__ import annotations

import hashlib
import logging
from typing import NamedTuple

from ferrylm.engine.block_manager import block_hashes
from ferrylm.http import prompt_ids
from ferrylm.http.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("ferrylm.router")
MAX_HASHED_BLOCKS = 128  # prefixes deeper than this many blocks route like their first 128
DEFAULT_BLOCK_SIZE = 16
CHARS_PER_TOKEN = 4  # the estimate when no tokenizer is available


def load_tokenizer(model: str):
    """The ferrylm Tokenizer of a model source (alias, .gguf, HF directory), or raise."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model(model))


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _chat_text(request: ChatCompletionRequest) -> str:
    return "\n".join(f"{m.role}: {m.text()}" for m in request.messages)


def prompt_token_lists(tokenizer, request: ChatCompletionRequest | CompletionRequest) -> list[list[int]]:
    if isinstance(request, ChatCompletionRequest):
        return [prompt_ids.chat_prompt_ids(tokenizer, request)]
    return prompt_ids.completion_prompt_ids(tokenizer, request, tokenizer.vocab_size)


class PromptInfo(NamedTuple):
    prompt_lens: list[int]  # tokens of each prompt (a chat request has one)
    hashes: tuple[int, ...]  # the engine's block hashes of the first prompt (exact tokens only)
    key: int | None  # a text affinity key when the tokens are estimated
    token_ids: tuple[int, ...] = ()  # the prompt's exact ids when there is one prompt and a tokenizer


def describe(tokenizer, block_size: int | None, request: ChatCompletionRequest | CompletionRequest,
             cache_salt: str | None = None) -> PromptInfo:
    """Token counts per prompt and the prefix-affinity key of a request (hashed under its cache
    salt, as the replica will: one tenant's prompt never routes as another's cache hit)."""
    if tokenizer is not None:
        prompts = prompt_token_lists(tokenizer, request)
        size = block_size or DEFAULT_BLOCK_SIZE
        first = prompts[0][:MAX_HASHED_BLOCKS * size] if prompts else []
        return PromptInfo([len(p) for p in prompts], tuple(block_hashes(first, size, cache_salt=cache_salt)), None,
                          tuple(prompts[0]) if len(prompts) == 1 else ())
    if isinstance(request, ChatCompletionRequest):
        texts = [_chat_text(request)]
    else:
        p = request.prompt
        texts = [p] if isinstance(p, str) else [str(x) for x in p] if p and not isinstance(p[0], int) else [str(p)]
    lens = [len(t) // CHARS_PER_TOKEN + 1 for t in texts]
    return PromptInfo(lens, (), _stable_hash(f"{cache_salt}\0{texts[0][:512]}") if texts else None)
