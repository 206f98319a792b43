"""RequestOutput → OpenAI JSON responses and SSE chunks, for chat completions and completions.

Streams flush one event per engine step (never buffered; with tools, text that may be a tool call is
held until it is clear, tools.ToolStream): the role chunk first (chat), content deltas, each choice's
finish_reason, the usage chunk when asked, then `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import cast

from pydantic import BaseModel

from ferrylm.engine.client import EngineDeadError
from ferrylm.http import safe_json
from ferrylm.http.errors import APIError, engine_dead
from ferrylm.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    CompletionTokensDetails,
    DeltaMessage,
    FinishReasonStr,
    PromptTokensDetails,
    UsageInfo,
)
from ferrylm.observability.request_timeline import RequestTimeline
from ferrylm.outputs import FinishReason, RequestOutput, Usage
from ferrylm.server.fanout import Fanout
from ferrylm.server.logprobs import chat_logprobs, completion_logprobs, echoed_prompt_logprobs, vllm_prompt_logprobs
from ferrylm.server.reasoning import ReasoningParser, ReasoningStream, split_delta
from ferrylm.server.tools import ToolPlan, ToolStream, call_deltas
from ferrylm.tokenizer import Tokenizer

log = logging.getLogger("ferrylm.server")
DONE = "data: [DONE]\n\n"


@dataclass
class ResponseContext:
    """What every response and chunk of one request shares."""

    request_id: str
    model: str
    tokenizer: Tokenizer
    top_logprobs: int | None = None  # None: no logprobs asked
    include_usage: bool = False
    echo: list[str] | None = None  # completions with echo: each prompt's text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs on /v1/completions: alternatives per token
    tools: ToolPlan | None = None  # chat with tool calling: the output is parsed into tool_calls
    timings: bool = False  # the request's `"timings": true`: llama.cpp's timings object at the end
    reasoning: ReasoningParser | None = None  # --reasoning-parser: thinking split from the answer
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.monotonic)


def sse(event: BaseModel | dict) -> str:
    """One SSE event; always strict JSON in valid UTF-8, whatever the model emitted (safe_json)."""
    return f"data: {safe_json.dumps(event)}\n\n"


def usage(fanout: Fanout, finals: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per prompt (not per sample), as OpenAI bills them (Usage.of)."""
    u = Usage.of([len(p) for p in fanout.prompts], sum(len(out.outputs[0].token_ids) for out in finals),
                 fanout.num_cached_tokens)
    return UsageInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     total_tokens=u.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens))


def _reason(out: RequestOutput) -> FinishReasonStr | None:
    reason = out.outputs[0].finish_reason
    value = reason.value if isinstance(reason, FinishReason) else reason
    return cast(FinishReasonStr, value)


def log_finished(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput], stream: bool) -> None:
    u = usage(fanout, finals)
    log.info("request finished", extra={
        "request_id": ctx.request_id, "stream": stream, "finish_reasons": [_reason(f) for f in finals],
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "seconds": round(time.monotonic() - ctx.start, 4)})


def timings(ctx: ResponseContext, finals: list[RequestOutput]) -> dict | None:
    """The `timings` object when the request asked for it (None otherwise, and left out)."""
    if not ctx.timings:
        return None
    timeline = RequestTimeline.of(ctx.start, finals)
    return timeline.timings() if timeline is not None else None


async def collect(fanout: Fanout) -> list[RequestOutput]:
    """Run a non-streaming request to the end; the final output of every choice, in index order."""
    try:
        async for _ in fanout:
            pass
    finally:
        await fanout.aclose()
    return fanout.finals()


def _new_tokens(out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
    """This step's token ids and their logprobs (cumulative or delta outputs alike)."""
    c = out.outputs[0]
    start = len(c.token_ids) - len(c.token_ids_delta)
    return c.token_ids[start:], (c.logprobs or [])[start:len(c.token_ids)]


# -- chat ------------------------------------------------------------------------------------
def chat_response(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> ChatCompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        c = out.outputs[0]
        lp = None
        if ctx.top_logprobs is not None and c.logprobs is not None:
            lp = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, ctx.top_logprobs)
        thinking, answer = ctx.reasoning.split(c.text) if ctx.reasoning is not None else (None, c.text)
        content, calls = ctx.tools.parse(answer or "") if ctx.tools is not None else (answer, [])
        choices.append(ChatChoice(index=i, message=AssistantMessage(
            content=content, tool_calls=calls or None, reasoning=thinking, reasoning_content=thinking),
            logprobs=lp, finish_reason=_tool_reason(out, calls)))
    log_finished(ctx, fanout, finals, stream=False)
    return ChatCompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                                  usage=chat_usage(ctx, fanout, finals), timings=timings(ctx, finals))


def chat_usage(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> UsageInfo:
    """usage, with completion_tokens_details.reasoning_tokens under --reasoning-parser (the thinking's
    tokens, counted by encoding its text and its tags)."""
    u = usage(fanout, finals)
    if ctx.reasoning is not None:
        tags = ctx.reasoning.start + ctx.reasoning.end
        counted = 0
        for out in finals:
            thinking, _ = ctx.reasoning.split(out.outputs[0].text)
            if thinking is not None:
                counted += min(len(out.outputs[0].token_ids), len(ctx.tokenizer.encode(thinking + tags, False)))
        u.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=counted)
    return u


def _tool_reason(out: RequestOutput, calls: list) -> FinishReasonStr | None:
    """OpenAI's `tool_calls` when the model ended by itself with calls; a cut-off output stays `length`."""
    reason = _reason(out)
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_chunk(ctx: ResponseContext, choice: ChatStreamChoice) -> str:
    return sse(ChatCompletionChunk(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice]))


def _chat_deltas(ctx: ResponseContext, index: int, out: RequestOutput, tool: ToolStream | None,
                 thinking: ReasoningStream | None) -> list[str]:
    c = out.outputs[0]
    events = []
    reasoning, answer = split_delta(thinking, c.text_delta, out.finished)
    if reasoning:
        events.append(_chat_chunk(ctx, ChatStreamChoice(index=index, delta=DeltaMessage(
            reasoning=reasoning, reasoning_content=reasoning))))
    text = tool.feed(answer) if tool is not None else answer
    if text or (ctx.top_logprobs is not None and c.token_ids_delta):
        lp = None
        if ctx.top_logprobs is not None:
            lp = chat_logprobs(ctx.tokenizer, *_new_tokens(out), ctx.top_logprobs)
        events.append(_chat_chunk(ctx, ChatStreamChoice(index=index, delta=DeltaMessage(content=text or ""),
                                                        logprobs=lp)))
    if out.finished:
        calls: list = []
        if tool is not None:
            rest, calls = tool.finish()
            if rest or calls:
                events.append(_chat_chunk(ctx, ChatStreamChoice(index=index, delta=DeltaMessage(
                    content=rest or None, tool_calls=call_deltas(calls) or None))))
        events.append(_chat_chunk(ctx, ChatStreamChoice(index=index, delta=DeltaMessage(),
                                                        finish_reason=_tool_reason(out, calls))))
    return events


def stream_chat(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    """`chat.completion.chunk` events for a started Fanout; closes it however the stream ends."""
    return guarded(ctx, fanout, _chat_events(ctx, fanout))


async def _chat_events(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    for i in range(fanout.num_choices):
        yield _chat_chunk(ctx, ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
    tools = {i: ToolStream(ctx.tools) for i in range(fanout.num_choices)} if ctx.tools is not None else {}
    thinking = {i: ReasoningStream(ctx.reasoning) for i in range(fanout.num_choices)} \
        if ctx.reasoning is not None else {}
    async for index, out in fanout:
        for event in _chat_deltas(ctx, index, out, tools.get(index), thinking.get(index)):
            yield event
    for event in _closing_events(ctx, fanout, lambda u: ChatCompletionChunk(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=u),
            lambda finals: chat_usage(ctx, fanout, finals)):
        yield event


def _closing_events(ctx: ResponseContext, fanout: Fanout, usage_chunk: Callable,
                    usage_of: Callable | None = None) -> list[str]:
    """After every choice finished: the usage chunk when asked for (carrying `timings` when asked
    for too; alone, they come in a chunk of their own), and the request's log line."""
    finals = fanout.finals()
    counted = usage_of(finals) if usage_of is not None else usage(fanout, finals)
    closing = usage_chunk(counted if ctx.include_usage else None)
    closing.timings = timings(ctx, finals)
    events = [sse(closing)] if ctx.include_usage or closing.timings is not None else []
    log_finished(ctx, fanout, finals, stream=True)
    return events


async def guarded(ctx: ResponseContext, fanout: Fanout, body: AsyncGenerator[str, None],
                  error_event: Callable[[APIError], str] | None = None, end: str | None = DONE
                  ) -> AsyncGenerator[str, None]:
    """The SSE skeleton every streaming endpoint shares: a failure is reported in-band (the status
    line is already sent, as OpenAI does; `error_event` shapes it, OpenAI's error chunk by default),
    the fanout is closed however the stream ends, `end` ([DONE]; None for Anthropic's) comes last."""
    try:
        async for event in body:
            yield event
    except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band like OpenAI
        err = _stream_failure(ctx, e)
        yield error_event(err) if error_event is not None else sse(err.body())
    except BaseException:  # closed or cancelled: the client went away (or the server is stopping)
        log.info("stream closed early; request aborted", extra={"request_id": ctx.request_id})
        raise
    finally:
        await body.aclose()
        await fanout.aclose()
    if end is not None:
        yield end


def _stream_failure(ctx: ResponseContext, exc: Exception) -> APIError:
    log.error("stream failed", exc_info=exc, extra={"request_id": ctx.request_id})
    if isinstance(exc, EngineDeadError):
        return engine_dead()
    return exc if isinstance(exc, APIError) else APIError(500, f"The stream failed: {exc}")


# -- completions -----------------------------------------------------------------------------
def _echo(ctx: ResponseContext, fanout: Fanout, index: int) -> str:
    return ctx.echo[index // fanout.n] if ctx.echo else ""


def completion_response(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> CompletionResponse:
    choices = []
    for i, out in enumerate(finals):
        c = out.outputs[0]
        prefix = _echo(ctx, fanout, i)
        lp = None
        if ctx.top_logprobs is not None and c.logprobs is not None:
            lp = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, ctx.top_logprobs, len(prefix))
            if ctx.echo and out.prompt_logprobs is not None:  # echo + logprobs: the prompt's tokens come first
                lp = echoed_prompt_logprobs(ctx.tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                                            ctx.top_logprobs, lp)
        plp = None
        if ctx.prompt_logprobs is not None and out.prompt_logprobs is not None:
            plp = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, ctx.prompt_logprobs)
        choices.append(CompletionChoice(index=i, text=prefix + c.text, logprobs=lp, finish_reason=_reason(out),
                                        prompt_logprobs=plp))
    log_finished(ctx, fanout, finals, stream=False)
    return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                              usage=usage(fanout, finals), timings=timings(ctx, finals))


def _completion_chunk(ctx: ResponseContext, index: int, out: RequestOutput, sent: dict[int, int]) -> str | None:
    """The text/logprobs this step added to choice `index` (and its finish_reason when done)."""
    c = out.outputs[0]
    has_tokens = ctx.top_logprobs is not None and bool(c.token_ids_delta)
    if not (c.text_delta or has_tokens or out.finished):
        return None
    text = c.text_delta
    lp = None
    if has_tokens and ctx.top_logprobs is not None:
        offset = sent.get(index, 0)
        lp = completion_logprobs(ctx.tokenizer, *_new_tokens(out), ctx.top_logprobs, offset)
    sent[index] = sent.get(index, 0) + len(text)
    choice = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=_reason(out) if out.finished else None)
    return sse(CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice]))


def stream_completion(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    """`text_completion` events for a started Fanout; closes it however the stream ends."""
    return guarded(ctx, fanout, _completion_events(ctx, fanout))


async def _completion_events(ctx: ResponseContext, fanout: Fanout) -> AsyncGenerator[str, None]:
    sent: dict[int, int] = {}  # characters streamed per choice (for logprobs text_offset)
    if ctx.echo:
        for i in range(fanout.num_choices):
            text = _echo(ctx, fanout, i)
            sent[i] = len(text)
            yield sse(CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model,
                                         choices=[CompletionChoice(index=i, text=text)]))
    async for index, out in fanout:
        event = _completion_chunk(ctx, index, out, sent)
        if event is not None:
            yield event
    for event in _closing_events(ctx, fanout, lambda u: CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=u)):
        yield event
