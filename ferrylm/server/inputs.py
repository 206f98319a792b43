"""Request → engine inputs: SamplingParams and the context-window check (prompt rendering is in
http/prompt_ids.py, shared with the router).

Everything a user can get wrong is caught here and answered with a 400 before the engine sees it.
"""

from __future__ import annotations

import json

from ferrylm.http.errors import APIError, invalid
from ferrylm.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from ferrylm.request_limits import ContextLengthExceeded, check_context_window, check_token_ids
from ferrylm.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from ferrylm.server import structured, tools
from ferrylm.server.unsupported_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_supported


def check_fits(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, what: str) -> None:
    """The context-window rule (request_limits, shared with the scheduler) as a 400."""
    try:
        check_context_window(len(prompt_ids), max_tokens, max_model_len, what)
    except ContextLengthExceeded as e:
        raise APIError(400, str(e), e.param, e.code) from None


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"Invalid 'logit_bias': key {key!r} is not a token id.", "logit_bias") from None
        bias[token_id] = value
    return bias


def sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    vocab_size: int, prompt_logprobs: int | None = None,
                    tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """Build the engine's SamplingParams; a range error or a token id outside the vocabulary
    (request_limits.check_token_ids, the engine's own check) becomes a 400 naming the field.
    `tool_constraint`: a forced tool choice's grammar (tools.py), exclusive with response_format."""
    r = request
    constraint = structured.from_request(r)
    if tool_constraint is not None:
        if constraint is not None:
            raise invalid(f"'{constraint.param}' cannot be combined with a forced 'tool_choice'.", constraint.param)
        constraint = tool_constraint
    try:
        params = SamplingParams(
            n=r.n or 1, temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            top_k=r.top_k if r.top_k is not None and r.top_k > 0 else None,
            min_p=r.min_p or 0.0, presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
            logit_bias=_logit_bias(r.logit_bias), seed=r.seed, max_tokens=max_tokens,
            min_tokens=r.min_tokens or 0, stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []),
            stop_token_ids=list(r.stop_token_ids or []),
            include_stop_str_in_output=bool(r.include_stop_str_in_output), ignore_eos=bool(r.ignore_eos),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=r.skip_special_tokens is not False,
            structured_outputs=constraint, cache_salt=(r.model_extra or {}).get("cache_salt"))
        check_token_ids(params, vocab_size)
    except SamplingParamsError as e:
        raise invalid(f"Invalid '{e.param}': {str(e).rstrip('.')}.", e.param) from None
    return params


def check_streaming_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")


def chat_params(request: ChatCompletionRequest, vocab_size: int) -> tuple[SamplingParams, tools.ToolPlan | None]:
    """The engine's SamplingParams and the tool plan the answer is shaped by (None: no tool calling)."""
    check_supported(request, CHAT_FIELDS)
    check_streaming_options(request)
    check_tool_messages(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    plan = tools.plan(request)
    return sampling_params(request, max_tokens, logprobs, vocab_size,
                           tool_constraint=plan.constraint() if plan is not None else None), plan


def check_tool_messages(request: ChatCompletionRequest) -> None:
    """OpenAI's rules for the calls in a conversation: an assistant call's `arguments` is JSON text,
    and a `tool` message answers a call made earlier in the conversation, named by its id."""
    called: set[str] = set()
    for i, message in enumerate(request.messages):
        for j, call in enumerate(message.tool_calls or []):
            try:
                json.loads(call.function.arguments)
            except (ValueError, RecursionError):
                raise invalid(f"Invalid 'messages[{i}].tool_calls[{j}].function.arguments': not valid JSON text.",
                              f"messages.{i}.tool_calls.{j}.function.arguments") from None
            called.add(call.id)
        if message.role == "tool" and not message.tool_call_id:
            raise invalid(f"Invalid 'messages[{i}]': a 'tool' message needs 'tool_call_id'.",
                          f"messages.{i}.tool_call_id")
        if message.role == "tool" and message.tool_call_id not in called:
            raise invalid(f"Invalid parameter: messages with role 'tool' must be a response to a preceding message "
                          f"with 'tool_calls'; 'messages[{i}].tool_call_id' {message.tool_call_id!r} matches none.",
                          f"messages.{i}.tool_call_id")


def completion_params(request: CompletionRequest, vocab_size: int) -> SamplingParams:
    check_supported(request, COMPLETION_FIELDS)
    check_streaming_options(request)
    if request.suffix:
        raise invalid("'suffix' is not supported.", "suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise invalid("'best_of' must equal 'n' (ranking candidates is not supported).", "best_of")
    prompt_logprobs = completion_prompt_logprobs(request)
    if prompt_logprobs is not None and request.stream:
        raise invalid("Prompt logprobs (echo with logprobs, or prompt_logprobs) are not streamed; send "
                      "'stream': false.", "stream")
    return sampling_params(request, request.max_tokens, request.logprobs, vocab_size, prompt_logprobs)


def completion_prompt_logprobs(request: CompletionRequest) -> int | None:
    """Alternatives per prompt token the engine computes: `echo` with `logprobs` (OpenAI's legacy
    scoring request, as lm-evaluation-harness sends it) and vLLM's `prompt_logprobs` share one pass."""
    wanted = [k for k in (request.logprobs if request.echo else None, request.prompt_logprobs) if k is not None]
    return max(wanted) if wanted else None
