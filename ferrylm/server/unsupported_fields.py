"""Request fields the server does not implement yet but that would change the output: refused
with a 400 naming the field (never silently different output than asked for)."""

from __future__ import annotations

import json
import logging

from ferrylm.http.errors import APIError
from ferrylm.http.protocol import ChatMessage, SamplingRequest

log = logging.getLogger("ferrylm.server")

# Fields of OpenAI's or vLLM's API that would change the output and are not implemented yet, each
# with the values that ask for nothing beyond the default (null always does). Any other value is
# refused with a 400 naming the field: never silently different output than asked for.
# Implementing one means deleting its entry (and honouring it).
_UNSUPPORTED: dict[str, tuple] = {
    # OpenAI
    "functions": ([],),
    "function_call": ("none",), "audio": (), "modalities": (["text"],), "prediction": (),
    "web_search_options": (), "reasoning_effort": (), "verbosity": (), "moderation": (),
    # vLLM
    "guided_whitespace_pattern": (),
    "use_beam_search": (False,), "length_penalty": (1.0,), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": ([],), "truncate_prompt_tokens": (), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "spaces_between_special_tokens": (True,), "vllm_xargs": (),
}
CHAT_FIELDS = _UNSUPPORTED | {
    "echo": (False,), "best_of": (1,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "add_special_tokens": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": (),
    "mm_processor_kwargs": (), "prompt_logprobs": (),  # prompt logprobs: /v1/completions only
}
COMPLETION_FIELDS = _UNSUPPORTED | {"add_special_tokens": (True,)}
_UNSUPPORTED_MESSAGE: dict[str, tuple] = {"function_call": (), "audio": ()}
_UNSUPPORTED_STREAM_OPTIONS: dict[str, tuple] = {"continuous_usage_stats": (False,)}
# Known fields that change nothing we generate: accepted without the "ignored fields" warning other
# unknown fields get.
# (vLLM's guided_json / _regex / _choice / _grammar / _decoding_backend: read by structured.py)
_NO_EFFECT = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                        "metadata", "store", "service_tier", "safety_identifier",
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
    unknown += check_messages(getattr(request, "messages", None) or [])
    if unknown:
        log.warning("unknown request fields ignored", extra={"fields": [name[:64] for name in unknown[:10]]})


def check_messages(messages: list[ChatMessage]) -> list[str]:
    """400 for a message field that is not implemented (tool_calls, ...), and for a message other than an
    assistant's without content (null or missing: OpenAI's 400, rather than an empty turn rendered into
    the prompt); the unknown fields' names."""
    unknown: list[str] = []
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise APIError(400, f"Missing required parameter: 'messages[{i}].content' (a {message.role!r} message "
                                "needs a string or a list of content parts).", f"messages.{i}.content",
                           "missing_required_parameter")
        unknown += _refuse(message.model_extra, _UNSUPPORTED_MESSAGE, f"messages.{i}.")
    return unknown
