"""POST /v1/responses (OpenAI's Responses API, stateless): the request runs as a one-choice chat
request (http/responses_protocol.py); this module shapes its output as a `response` object, or as
the Responses stream (`response.created` … `response.output_text.delta` … `response.completed`).

Output items: one `message` with an `output_text` part (when there is text), then one
`function_call` item per tool call. A response cut off by max_output_tokens is `incomplete`
(`incomplete_details.reason` `max_output_tokens`).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel, ConfigDict

from ferrylm.http import safe_json
from ferrylm.http.protocol import ToolCall
from ferrylm.http.responses_protocol import ResponsesRequest
from ferrylm.outputs import FinishReason, RequestOutput
from ferrylm.server.fanout import Fanout
from ferrylm.server.reasoning import ReasoningStream, split_delta
from ferrylm.server.serving import ResponseContext, chat_usage, guarded, log_finished
from ferrylm.server.tools import ToolStream


class ResponseObject(BaseModel):
    """The `response` object as built here (a dict's worth of OpenAI's fields)."""

    model_config = ConfigDict(extra="allow")


def _hex() -> str:
    return uuid.uuid4().hex[:24]


def echo_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a `response` object repeats back."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if request.text and request.text.format \
        else {"type": "text"}
    return {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
        "tool_choice": (request.tool_choice.model_dump() if isinstance(request.tool_choice, BaseModel)
                        else request.tool_choice or ("auto" if request.tools else "none")),
        "parallel_tool_calls": request.parallel_tool_calls is not False, "text": {"format": fmt},
        "store": False, "metadata": request.metadata or {}, "user": request.user, "previous_response_id": None,
        "reasoning": None, "truncation": "disabled", "background": False}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{_hex()}", "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments, "status": status}


def _status(out: RequestOutput | None) -> tuple[str, dict | None]:
    reason = out.outputs[0].finish_reason if out is not None else FinishReason.ABORT
    if reason == FinishReason.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == FinishReason.ABORT:
        return "incomplete", {"reason": "cancelled"}
    return "completed", None


def _response(ctx: ResponseContext, echo: dict, status: str, output: list[dict], fanout: Fanout | None = None,
              details: dict | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": ctx.request_id, "object": "response", "created_at": ctx.created, "model": ctx.model,
                            "status": status, "incomplete_details": details, "error": None, "output": output,
                            **echo, "usage": None}
    if fanout is not None:
        u = chat_usage(ctx, fanout, fanout.finals())
        thought = u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details is not None else 0
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
        body["usage"] = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
                         "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": thought},
                         "total_tokens": u.total_tokens}
    return body


def responses_shaper(echo: dict):
    """The non-streamed answer's shaper (app._serve's `shaper`)."""

    def shape(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> ResponseObject:
        out = finals[0]
        thinking, text = ctx.reasoning.split(out.outputs[0].text) if ctx.reasoning is not None \
            else (None, out.outputs[0].text)
        content, calls = ctx.tools.parse(text or "") if ctx.tools is not None else (text, [])
        status, details = _status(out)
        output = [_reasoning_item(f"rs_{_hex()}", thinking, "completed")] if thinking is not None else []
        output += [_message(f"msg_{_hex()}", content or "", "completed")] if content or not (calls or output) \
            else []
        output += [_call_item(call) for call in calls]
        log_finished(ctx, fanout, finals, stream=False)
        return ResponseObject(**_response(ctx, echo, status, output, fanout, details))

    return shape


def responses_streamer(echo: dict):
    """The streamed answer (app._serve's `streamer`)."""

    def stream(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
        return guarded(ctx, fanout, _events(ctx, fanout, echo))

    return stream


async def _events(ctx: ResponseContext, fanout: Fanout, echo: dict) -> AsyncGenerator[str, None]:
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {safe_json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"

    yield event("response.created", response=_response(ctx, echo, "in_progress", []))
    yield event("response.in_progress", response=_response(ctx, echo, "in_progress", []))
    msg_id, streamed, opened = f"msg_{_hex()}", "", False
    tool = ToolStream(ctx.tools) if ctx.tools is not None else None
    thinking = ReasoningStream(ctx.reasoning) if ctx.reasoning is not None else None
    rs_id, thought, rs_open = f"rs_{_hex()}", "", False
    final: RequestOutput | None = None
    output: list[dict] = []  # the items done so far
    msg_index = 0  # the message's output_index: 1 after a reasoning item

    def open_message() -> list[str]:
        return [event("response.output_item.added", output_index=msg_index,
                      item=_message(msg_id, "", "in_progress") | {"content": []}),
                event("response.content_part.added", item_id=msg_id, output_index=msg_index, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def close_reasoning() -> list[str]:
        item = _reasoning_item(rs_id, thought, "completed")
        output.append(item)
        return [event("response.reasoning_text.done", item_id=rs_id, output_index=0, content_index=0, text=thought),
                event("response.output_item.done", output_index=0, item=item)]

    async for _, out in fanout:
        delta = out.outputs[0].text_delta
        reasoning, answer = split_delta(thinking, delta, out.finished)
        if reasoning:
            if not rs_open:
                yield event("response.output_item.added", output_index=0,
                            item=_reasoning_item(rs_id, "", "in_progress") | {"content": []})
                rs_open, msg_index = True, 1
            thought += reasoning
            yield event("response.reasoning_text.delta", item_id=rs_id, output_index=0, content_index=0,
                        delta=reasoning)
        text = tool.feed(answer) if tool is not None else answer
        if text:
            if rs_open and not output:
                for e in close_reasoning():
                    yield e
            if not opened:
                for e in open_message():
                    yield e
                opened = True
            streamed += text
            yield event("response.output_text.delta", item_id=msg_id, output_index=msg_index, content_index=0,
                        delta=text, logprobs=[])
        if out.finished:
            final = out
    if rs_open and not output:
        for e in close_reasoning():
            yield e
    rest, calls = tool.finish() if tool is not None else ("", [])
    if rest or (not opened and not calls and not output):
        if not opened:
            for e in open_message():
                yield e
            opened = True
        if rest:
            streamed += rest
            yield event("response.output_text.delta", item_id=msg_id, output_index=msg_index, content_index=0,
                        delta=rest, logprobs=[])
    if opened:
        message = _message(msg_id, streamed, "completed")
        yield event("response.output_text.done", item_id=msg_id, output_index=msg_index, content_index=0,
                    text=streamed, logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=msg_index, content_index=0,
                    part=message["content"][0])
        yield event("response.output_item.done", output_index=msg_index, item=message)
        output.append(message)
    for call in calls:
        item, index = _call_item(call), len(output)
        yield event("response.output_item.added", output_index=index, item=item | {"arguments": "",
                                                                                   "status": "in_progress"})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
        output.append(item)
    status, details = _status(final)
    log_finished(ctx, fanout, fanout.finals(), stream=True)
    yield event("response.completed" if status == "completed" else "response.incomplete",
                response=_response(ctx, echo, status, output, fanout, details))
