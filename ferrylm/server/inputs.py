"""Request → engine inputs: chat template, tokenization, SamplingParams, and the context-window check.

Everything a user can get wrong is caught here and answered with a 400 before the engine sees it.
"""

from __future__ import annotations

from jinja2 import TemplateError

from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.server.errors import APIError, invalid
from ferrylm.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from ferrylm.tokenizer import Tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the model's own chat template and tokenize it."""
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in request.messages]
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
    for tokens in ids:
        if not tokens:
            raise invalid("The prompt must not be empty.", "prompt")
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid(f"Token id {bad} in the prompt is outside the vocabulary (size {vocab_size}).", "prompt")
    return ids


def check_fits(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, what: str) -> None:
    """Reject a prompt (plus max_tokens) longer than the context window, with OpenAI's wording."""
    n = len(prompt_ids)
    if n >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                            f"{what} resulted in {n} tokens. Please reduce the length of the {what}.",
                       what, "context_length_exceeded")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the "
                            "completion). Please reduce the length of the messages or completion.",
                       "max_tokens", "context_length_exceeded")


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"Invalid 'logit_bias': key {key!r} is not a token id.", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise invalid(f"Invalid 'logit_bias': token id {token_id} is outside the vocabulary "
                          f"(size {vocab_size}).", "logit_bias")
        bias[token_id] = value
    return bias


def sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                    vocab_size: int) -> SamplingParams:
    """Build the engine's SamplingParams; a range error becomes a 400 naming the field."""
    bad_stop_id = next((t for t in request.stop_token_ids or [] if not 0 <= t < vocab_size), None)
    if bad_stop_id is not None:
        raise invalid(f"Invalid 'stop_token_ids': {bad_stop_id} is outside the vocabulary.", "stop_token_ids")
    r = request
    try:
        return SamplingParams(
            n=r.n or 1, temperature=1.0 if r.temperature is None else r.temperature,
            top_p=1.0 if r.top_p is None else r.top_p,
            top_k=r.top_k if r.top_k is not None and r.top_k > 0 else None,
            min_p=r.min_p or 0.0, presence_penalty=r.presence_penalty or 0.0,
            frequency_penalty=r.frequency_penalty or 0.0,
            repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
            logit_bias=_logit_bias(r.logit_bias, vocab_size), seed=r.seed, max_tokens=max_tokens,
            min_tokens=r.min_tokens or 0, stop=[r.stop] if isinstance(r.stop, str) else list(r.stop or []),
            stop_token_ids=list(r.stop_token_ids or []),
            include_stop_str_in_output=bool(r.include_stop_str_in_output), ignore_eos=bool(r.ignore_eos),
            logprobs=logprobs, skip_special_tokens=r.skip_special_tokens is not False)
    except SamplingParamsError as e:
        raise invalid(f"Invalid '{e.param}': {e}.", e.param) from None


def check_streaming_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")


def chat_params(request: ChatCompletionRequest, vocab_size: int) -> SamplingParams:
    check_streaming_options(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    return sampling_params(request, max_tokens, logprobs, vocab_size)


def completion_params(request: CompletionRequest, vocab_size: int) -> SamplingParams:
    check_streaming_options(request)
    if request.suffix:
        raise invalid("'suffix' is not supported.", "suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise invalid("'best_of' must equal 'n' (ranking candidates is not supported).", "best_of")
    if request.echo and request.logprobs is not None:
        raise invalid("'echo' with 'logprobs' is not supported (prompt logprobs are not computed).", "echo")
    return sampling_params(request, request.max_tokens, request.logprobs, vocab_size)
