"""POST /v1/messages (Anthropic's Messages API): the request runs as a one-choice chat request
(http/messages_protocol.py); this module shapes its output as a `message` object, or as Anthropic's
event stream: message_start, ping, per content block content_block_start / _delta / _stop (text as
text_delta, a tool call's input as input_json_delta), message_delta (stop_reason, output usage),
message_stop. A failure after the status line is an in-band `error` event, as Anthropic sends it.

With --reasoning-parser the thinking comes first as a `thinking` block (thinking_delta events; the
signature is empty: nothing here signs it).

stop_reason: end_turn (EOS or a stop token), stop_sequence (with the matched `stop_sequence`),
max_tokens, tool_use (the answer holds tool_use blocks).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from ferrylm.http import safe_json
from ferrylm.http.messages_protocol import anthropic_error_body
from ferrylm.http.protocol import ToolCall
from ferrylm.outputs import FinishReason, RequestOutput
from ferrylm.server.fanout import Fanout
from ferrylm.server.reasoning import ReasoningStream, split_delta
from ferrylm.server.serving import ResponseContext, guarded, log_finished, usage
from ferrylm.server.tools import ToolStream


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.function.name,
            "input": arguments if isinstance(arguments, dict) else {}}


def _stop(out: RequestOutput | None, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if has_calls:
        return "tool_use", None
    completion = out.outputs[0] if out is not None else None
    if completion is not None and completion.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if completion is not None and isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(fanout: Fanout | None, output_tokens: int | None = None) -> dict[str, int]:
    if fanout is None:
        return {"input_tokens": 0, "output_tokens": 0}
    u = usage(fanout, fanout.finals())
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": u.completion_tokens if output_tokens is None else output_tokens}


def _message(ctx: ResponseContext, content: list[dict], stop: tuple[str | None, str | None],
             usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": ctx.request_id, "type": "message", "role": "assistant", "model": ctx.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage_}


def messages_response(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> dict[str, Any]:
    """The non-streamed answer (app._serve's `shaper`)."""
    out = finals[0]
    thinking, text = ctx.reasoning.split(out.outputs[0].text) if ctx.reasoning is not None \
        else (None, out.outputs[0].text)
    content_text, calls = ctx.tools.parse(text or "") if ctx.tools is not None else (text or "", [])
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thinking, "signature": ""}] \
        if thinking is not None else []
    content += [{"type": "text", "text": content_text or ""}] if content_text or not (calls or content) else []
    content += [_tool_use(call) for call in calls]
    log_finished(ctx, fanout, finals, stream=False)
    return _message(ctx, content, _stop(out, bool(calls)), _usage(fanout))


def messages_stream(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    """The streamed answer (app._serve's `streamer`): serving.guarded's skeleton, a failure as
    Anthropic's in-band `error` event and no [DONE] (Anthropic's stream ends with message_stop)."""
    return guarded(ctx, fanout, _events(ctx, fanout), end=None,
                   error_event=lambda err: _event("error", error=anthropic_error_body(err)["error"]))


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {safe_json.dumps({'type': kind, **fields})}\n\n"


async def _events(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    start = _usage(fanout, output_tokens=0)
    yield _event("message_start", message=_message(ctx, [], (None, None), start))
    yield _event("ping")
    tool = ToolStream(ctx.tools) if ctx.tools is not None else None
    thinking = ReasoningStream(ctx.reasoning) if ctx.reasoning is not None else None
    final: RequestOutput | None = None
    opened = False
    index = 0  # the text block's index: 1 after a thinking block
    thinking_open = False
    async for _, out in fanout:
        delta = out.outputs[0].text_delta
        reasoning, answer = split_delta(thinking, delta, out.finished)
        if reasoning:
            if not thinking_open:
                yield _event("content_block_start", index=0,
                             content_block={"type": "thinking", "thinking": "", "signature": ""})
                thinking_open, index = True, 1
            yield _event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": reasoning})
        text = tool.feed(answer) if tool is not None else answer
        if text:
            if thinking_open:
                yield _event("content_block_stop", index=0)
                thinking_open = False
            if not opened:
                yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                opened = True
            yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})
        if out.finished:
            final = out
    if thinking_open:
        yield _event("content_block_stop", index=0)
    rest, calls = tool.finish() if tool is not None else ("", [])
    if rest or (not opened and not calls and index == 0):
        if not opened:
            yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            opened = True
        if rest:
            yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": rest})
    if opened:
        yield _event("content_block_stop", index=index)
        index += 1
    for call in calls:
        block = _tool_use(call)
        yield _event("content_block_start", index=index, content_block=block | {"input": {}})
        yield _event("content_block_delta", index=index,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield _event("content_block_stop", index=index)
        index += 1
    stop_reason, stop_sequence = _stop(final, bool(calls))
    log_finished(ctx, fanout, fanout.finals(), stream=True)
    yield _event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 usage=_usage(fanout))  # cumulative, input tokens too (as Anthropic's message_delta now has)
    yield _event("message_stop")
