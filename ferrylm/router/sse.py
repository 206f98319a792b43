"""Server-sent events as the router reads them from a replica: whole events, unbuffered, with
the one JSON payload each carries parsed for accounting (never re-serialised)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import NamedTuple

import httpx

DONE = b"data: [DONE]\n\n"
# Responses API stream events (`type`): those carrying generated text, and those that end it
# (with the whole response, usage included)
RESPONSES_TOKEN_EVENTS = ("response.output_text.delta", "response.function_call_arguments.delta")
RESPONSES_FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
# Anthropic's Messages stream: no [DONE]; message_stop ends it, message_delta carries the usage
MESSAGES_TOKEN_DELTAS = ("text_delta", "input_json_delta")


def usage_counts(usage: dict) -> dict:
    """prompt_tokens / completion_tokens / cached_tokens of a usage object, from the Responses API's
    input_tokens / output_tokens (and input_tokens_details) where that is what it has, or from the
    Messages API's (input_tokens counts only what was not read from the cache there)."""
    if "cache_read_input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens")
        cached = cached if isinstance(cached, int) else 0
        fresh = usage.get("input_tokens")
        return {"prompt_tokens": fresh + cached if isinstance(fresh, int) else None,
                "completion_tokens": usage.get("output_tokens", 0), "cached_tokens": cached}
    chat = "prompt_tokens" in usage or "input_tokens" not in usage
    details = usage.get("prompt_tokens_details" if chat else "input_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    counts = usage if chat else {"prompt_tokens": usage.get("input_tokens"),
                                 "completion_tokens": usage.get("output_tokens", 0)}
    return counts | {"cached_tokens": cached if isinstance(cached, int) else 0}


class Event(NamedTuple):
    raw: bytes  # exactly what to send on (ends with a blank line)
    data: dict | None  # the decoded JSON payload, if it is one
    done: bool  # the `[DONE]` sentinel

    @property
    def tokens(self) -> int:
        """Choices in this chunk that carry generated text (≈ tokens, one per choice per step)."""
        if not self.data:
            return 0
        if self.data.get("type") in RESPONSES_TOKEN_EVENTS:
            return 1 if self.data.get("delta") else 0
        if self.data.get("type") == "content_block_delta":
            delta = self.data.get("delta") or {}
            return 1 if delta.get("type") in MESSAGES_TOKEN_DELTAS and (delta.get("text") or
                                                                        delta.get("partial_json")) else 0
        n = 0
        for choice in self.data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or choice.get("text"):
                n += 1
        return n

    @property
    def usage(self) -> dict | None:
        """The final usage chunk (`choices: []` with usage), as include_usage sends it, or the
        usage in a Responses stream's final event (as prompt_tokens / completion_tokens)."""
        data = self.data
        if data and data.get("type") in RESPONSES_FINAL_EVENTS:
            usage = (data.get("response") or {}).get("usage")
            return usage_counts(usage) if isinstance(usage, dict) else None
        if data and data.get("type") == "message_delta":
            usage = data.get("usage")
            return usage_counts(usage) if isinstance(usage, dict) and "cache_read_input_tokens" in usage else None
        if data and not data.get("choices") and isinstance(data.get("usage"), dict):
            return usage_counts(data["usage"])
        return None

    @property
    def error(self) -> dict | None:
        return self.data.get("error") if self.data and isinstance(self.data.get("error"), dict) else None

    @property
    def finished(self) -> bool:
        data = self.data or {}
        return data.get("type") in RESPONSES_FINAL_EVENTS or data.get("type") == "message_delta" or any(
            c.get("finish_reason") for c in data.get("choices") or ())


def _parse(lines: list[str]) -> Event:
    raw = ("\n".join(lines) + "\n\n").encode()
    payload = "\n".join(line[5:].lstrip(" ") for line in lines if line.startswith("data:"))
    if payload == "[DONE]":
        return Event(raw, None, True)
    try:
        data = json.loads(payload) if payload else None
    except json.JSONDecodeError:
        data = None
    data = data if isinstance(data, dict) else None
    return Event(raw, data, data is not None and data.get("type") == "message_stop")


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """Each SSE event of a streaming response as soon as its closing blank line arrives."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield _parse(lines)
            lines = []
    if lines:
        yield _parse(lines)


def error_event(message: str, code: str, type_: str = "server_error", anthropic: bool = False) -> bytes:
    """An in-band error (the status line is already sent), as the replica itself would send it
    (Anthropic's `error` event on a Messages stream)."""
    if anthropic:
        kind = "overloaded_error" if code in ("draining", "engine_dead") else "api_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()
