"""vLLM's tokenizer endpoints, /tokenize and /detokenize: the served model's own tokenizer and chat
template, the same code path that counts a generation request's prompt (http/prompt_ids.py), run
in a worker thread so a long text never blocks the event loop."""

from __future__ import annotations

import asyncio

from fastapi import Request

from ferrylm.http import prompt_ids
from ferrylm.http.body import read_json_body
from ferrylm.http.errors import invalid, parse_model
from ferrylm.http.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from ferrylm.server import gatekeeping
from ferrylm.server.state import ServerState
from ferrylm.server.unsupported_fields import check_messages


def _state(request: Request) -> ServerState:
    return request.app.state.ferry


async def tokenize(request: Request) -> TokenizeResponse:
    """Token ids of a `prompt` (special tokens added by default, as generation does) or of chat
    `messages` (the template's own BOS only, unless add_special_tokens); token strings on request."""
    state = _state(request)
    await gatekeeping.authenticate(request, state)
    info = state.admit().model_info
    req = parse_model(TokenizeRequest, await read_json_body(request, state.config.max_body_bytes))
    gatekeeping.check_model_allowed(request, state.resolve_model(req.model))
    if (req.prompt is None) == (req.messages is None):
        raise invalid("Send exactly one of 'prompt' (text) or 'messages' (a chat).",
                      "prompt" if req.messages is None else "messages")
    tokenizer = info.tokenizer
    if req.messages is not None:
        check_messages(req.messages)
        ids = await asyncio.to_thread(prompt_ids.render_messages, tokenizer, req.messages,
                                      req.add_generation_prompt, bool(req.add_special_tokens))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt or "", add_special)
    strs = await asyncio.to_thread(tokenizer.token_strings, ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(request: Request) -> DetokenizeResponse:
    """The text of `tokens` (special tokens kept, as vLLM's /detokenize); 400 naming `tokens` for an
    id outside the vocabulary."""
    state = _state(request)
    await gatekeeping.authenticate(request, state)
    info = state.admit().model_info
    req = parse_model(DetokenizeRequest, await read_json_body(request, state.config.max_body_bytes))
    gatekeeping.check_model_allowed(request, state.resolve_model(req.model))
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise invalid(f"Token id {req.tokens[bad]} at position {bad} is outside the vocabulary "
                      f"(0..{info.vocab_size - 1}).", "tokens")
    text = await asyncio.to_thread(info.tokenizer.decode, req.tokens, False)
    return DetokenizeResponse(prompt=text)
