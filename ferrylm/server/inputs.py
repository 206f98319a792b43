"""Request → engine inputs: chat template, tokenization, SamplingParams, and the context-window check.

Everything a user can get wrong is caught here and answered with a 400 before the engine sees it.
"""

from __future__ import annotations

import json
import logging

from jinja2 import TemplateError

from ferrylm.request_limits import ContextLengthExceeded, check_context_window, check_prompt_ids, check_token_ids
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.server.errors import APIError, invalid
from ferrylm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from ferrylm.tokenizer import Tokenizer

log = logging.getLogger("ferrylm.server")

# Fields of OpenAI's or vLLM's API that would change the output and are not implemented yet, each
# with the values that ask for nothing beyond the default (null always does). Any other value is
# refused with a 400 naming the field: never silently different output than asked for.
# Implementing one means deleting its entry (and honouring it).
_UNSUPPORTED: dict[str, tuple] = {
    # OpenAI
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "audio": (), "modalities": (["text"],), "prediction": (),
    "web_search_options": (), "reasoning_effort": (), "verbosity": (), "moderation": (),
    # vLLM
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "prompt_logprobs": (),
    "use_beam_search": (False,), "length_penalty": (1.0,), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": ([],), "truncate_prompt_tokens": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "spaces_between_special_tokens": (True,), "vllm_xargs": (),
}
_UNSUPPORTED_CHAT = _UNSUPPORTED | {
    "echo": (False,), "best_of": (1,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
    "mm_processor_kwargs": (),
}
_UNSUPPORTED_COMPLETION = _UNSUPPORTED | {"add_special_tokens": (True,)}
_UNSUPPORTED_MESSAGE = {"tool_calls": ([],), "tool_call_id": (), "function_call": (), "audio": ()}
_UNSUPPORTED_STREAM_OPTIONS = {"continuous_usage_stats": (False,)}
# Known fields that change nothing we generate (parallel_tool_calls: nothing without tools, which
# are refused): accepted without the "ignored fields" warning other unknown fields get.
_NO_EFFECT = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
                        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "cache_salt",
                        "request_id"})


def _unsupported(param: str, neutral: tuple) -> APIError:
    accepted = " or ".join(json.dumps(value) for value in neutral)
    until = f" (until it is, only {accepted} or null is accepted)" if accepted else ""
    return APIError(400, f"Unsupported parameter: '{param}' is not supported by this server yet{until}; it is "
                         "refused rather than ignored because it would change the output.", param,
                    "unsupported_parameter")


def _refuse(fields: dict | None, table: dict[str, tuple], prefix: str = "") -> list[str]:
    """Raise for the first field (in `table`'s order) asking for something; return the names of the
    fields `table` does not know."""
    fields = fields or {}
    for name, neutral in table.items():
        if fields.get(name) is not None and fields[name] not in neutral:
            raise _unsupported(prefix + name, neutral)
    return [prefix + name for name in fields if name not in table and name not in _NO_EFFECT]


def check_supported(request: SamplingRequest, table: dict[str, tuple]) -> None:
    """400 for a field (top level, in stream_options or in a message) that would change the output
    but is not implemented; a warning naming the other unknown fields, which are ignored."""
    unknown = _refuse(request.model_extra, table)
    if request.stream_options is not None:
        unknown += _refuse(request.stream_options.model_extra, _UNSUPPORTED_STREAM_OPTIONS, "stream_options.")
    for i, message in enumerate(getattr(request, "messages", ())):
        unknown += _refuse(message.model_extra, _UNSUPPORTED_MESSAGE, f"messages.{i}.")
    if unknown:
        log.warning("unknown request fields ignored", extra={"fields": [name[:64] for name in unknown[:10]]})


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the model's own chat template and tokenize it (a message's
    `name` is passed on, for templates that use it)."""
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    | ({"name": m.name} if m.name is not None else {}) for m in request.messages]
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    except (TemplateError, ValueError) as e:
        raise invalid(f"The messages could not be rendered with the chat template: {e}", "messages") from None


def completion_prompt_ids(tokenizer: Tokenizer, request: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """One token list per prompt: `prompt` may be text, texts, token ids, or lists of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise invalid("The prompt must not be empty.", "prompt")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if not all(ids):
        raise invalid("The prompt must not be empty.", "prompt")
    try:
        check_prompt_ids(ids, vocab_size)
    except SamplingParamsError as e:
        raise invalid(str(e), e.param) from None
    return ids


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
                    vocab_size: int) -> SamplingParams:
    """Build the engine's SamplingParams; a range error or a token id outside the vocabulary
    (request_limits.check_token_ids, the engine's own check) becomes a 400 naming the field."""
    r = request
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
            logprobs=logprobs, skip_special_tokens=r.skip_special_tokens is not False)
        check_token_ids(params, vocab_size)
    except SamplingParamsError as e:
        raise invalid(f"Invalid '{e.param}': {str(e).rstrip('.')}.", e.param) from None
    return params


def check_streaming_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")


def chat_params(request: ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    check_supported(request, _UNSUPPORTED_CHAT)
    check_streaming_options(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    return sampling_params(request, max_tokens, logprobs, vocab_size)


def completion_params(request: CompletionRequest, vocab_size: int) -> SamplingParams:
    check_supported(request, _UNSUPPORTED_COMPLETION)
    check_streaming_options(request)
    if request.suffix:
        raise invalid("'suffix' is not supported.", "suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise invalid("'best_of' must equal 'n' (ranking candidates is not supported).", "best_of")
    if request.echo and request.logprobs is not None:
        raise invalid("'echo' with 'logprobs' is not supported (prompt logprobs are not computed).", "echo")
    return sampling_params(request, request.max_tokens, request.logprobs, vocab_size)
