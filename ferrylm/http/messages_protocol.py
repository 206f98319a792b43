"""Anthropic's Messages API request (POST /v1/messages), its conversion to the chat request the rest
of the server runs (server/messages.py shapes the answer), and Anthropic's error body.

Content blocks: `text` (also in `system`), `tool_use` in assistant turns (the calls the model made)
and `tool_result` in user turns (their results, text only). `thinking` / `redacted_thinking` blocks of
earlier assistant turns are dropped, as Anthropic drops them from the context. `cache_control` is
accepted: prefix caching here is automatic. `output_config.format` (a JSON schema) is structured
output. `temperature`, `top_p` and `top_k` (older API versions; the SDK sends them as extra_body)
and `seed` are honoured. Images, documents, server tools, extended thinking, `output_config.effort`
and any field not known here are a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ferrylm.http.chat_dialect import ChatDialect, in_dialect_terms, joined_text
from ferrylm.http.errors import APIError, invalid, parse_model
from ferrylm.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ToolCall,
)

# Fields that ask for something not implemented, with the values that ask for nothing; any other
# field the model does not declare is refused too, as Anthropic refuses unknown fields.
UNSUPPORTED: dict[str, tuple] = {"thinking": ({"type": "disabled"},), "container": (), "mcp_servers": ([],),
                                 "context_management": ()}
# Accepted and without effect on what is generated: routing, caching and accounting hints.
NO_EFFECT = ("cache_control", "inference_geo", "speed", "service_tier", "diagnostics", "user_profile_id",
             "workspace_id")
# chat fields (as errors name them) → the Messages fields they came from
MESSAGES_PARAMS = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
                   "tool_choice": "tool_choice", "tools": "tools", "response_format": "output_config.format",
                   "response_format.json_schema": "output_config.format"}
MESSAGES = ChatDialect(("text",), "{where}: expected a string or a list of text blocks.",
                       "{where}.{j}: only text blocks are supported here (got {kind!r}).", MESSAGES_PARAMS,
                       (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences")))
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class MessagesTool(BaseModel):
    model_config = ConfigDict(extra="forbid")  # server tools (web_search...) have other fields: refused

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class MessagesToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesMetadata(BaseModel):
    user_id: str | None = None


class JsonOutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: JsonOutputFormat | None = None
    effort: None = None  # no reasoning model here: any effort level is refused by name


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked against UNSUPPORTED; the rest refused by name

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None
    # vLLM-style sampling extras: Anthropic's current API has none (older versions had the first three)
    seed: int | None = None
    # vLLM's, as on chat: the prefix-cache salt (the gateway sets it per tenant) and the queue priority
    cache_salt: str | None = None
    priority: int | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's (json, regex, choice, grammar), as on chat


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: MessagesToolChoice | None = None


def _assistant(content: Any, where: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or a list of content blocks.", where)
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                raise invalid(f"{where}.{j}: a tool_use block needs id, name and an object input.", f"{where}.{j}")
            calls.append(ToolCall(id=block["id"], function=FunctionCall(name=block["name"],
                                                                        arguments=json.dumps(block["input"]))))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # Anthropic drops earlier turns' thinking from the context too
        else:
            raise invalid(f"{where}.{j}: {kind!r} blocks are not supported in assistant turns.", f"{where}.{j}.type")
    return ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)


def _user(content: Any, where: str) -> list[ChatMessage]:
    """A user turn: its tool results (each a `tool` message, first, as the turn answers the calls),
    then its text."""
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or a list of content blocks.", where)
    results, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid(f"{where}.{j}: a tool_result block needs tool_use_id.", f"{where}.{j}.tool_use_id")
            text = joined_text(block.get("content", ""), f"{where}.{j}.content", MESSAGES)
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append(ChatMessage(role="tool", tool_call_id=block["tool_use_id"], content=text))
        else:
            raise invalid(f"{where}.{j}: {kind!r} blocks are not supported (text and tool_result are).",
                          f"{where}.{j}.type")
    return results + ([ChatMessage(role="user", content="\n".join(texts))] if texts else [])


def chat_messages(system: Any, messages: list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat conversation of a Messages request's `system` and `messages`."""
    out = [ChatMessage(role="system", content=joined_text(system, "system", MESSAGES))] if system else []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        where = f"messages.{i}.content"
        if role == "user":
            out += _user(message.get("content", ""), where)
        elif role == "assistant":
            out.append(_assistant(message.get("content", ""), where))
        else:
            raise invalid(f"messages.{i}.role: must be 'user' or 'assistant' (got {role!r}).", f"messages.{i}.role")
    return out


def _tools(request: MessagesRequest | CountTokensRequest) -> tuple[list[ChatTool] | None, Any, bool | None]:
    tools = [ChatTool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                                   parameters=t.input_schema))
             for t in request.tools or []]
    choice, parallel = request.tool_choice, None
    mapped: Any = None
    if choice is not None:
        parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise invalid("tool_choice.name: required when tool_choice.type is 'tool'.", "tool_choice.name")
            mapped = NamedToolChoice(type="function", function=NamedToolChoiceFunction(name=choice.name))
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return tools or None, mapped, parallel


def _refuse_unsupported(extra: dict[str, Any]) -> None:
    for name, value in extra.items():
        if name in NO_EFFECT or (name in UNSUPPORTED and (value is None or value in UNSUPPORTED[name])):
            continue
        raise invalid(f"{name}: this field is not supported by this server.", name, "unsupported_parameter")


def _response_format(request: MessagesRequest) -> dict[str, Any] | None:
    """output_config.format (Anthropic's structured outputs) as chat's json_schema response_format."""
    fmt = request.output_config.format if request.output_config is not None else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True}}


def to_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request this Messages request runs as (one choice; the same sampling, tools and
    output code). Anthropic's temperature range is 0-1, a subset of chat's."""
    _refuse_unsupported(request.model_extra or {})
    tools, choice, parallel = _tools(request)
    return parse_model(ChatCompletionRequest, {
        "model": request.model, "messages": chat_messages(request.system, request.messages),
        "max_completion_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "top_k": request.top_k, "stop": request.stop_sequences, "stream": request.stream,
        "user": request.metadata.user_id if request.metadata else None, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": parallel, "include_stop_str_in_output": False, "seed": request.seed,
        "response_format": _response_format(request), "priority": request.priority or 0,
        "structured_outputs": request.structured_outputs}
        | ({"cache_salt": request.cache_salt} if request.cache_salt is not None else {}))


def count_tokens_chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request whose prompt /v1/messages/count_tokens measures."""
    _refuse_unsupported({k: v for k, v in (request.model_extra or {}).items() if k != "thinking"})
    tools, choice, parallel = _tools(request)
    return parse_model(ChatCompletionRequest, {
        "model": request.model, "messages": chat_messages(request.system, request.messages), "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": parallel})


def as_chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    try:
        return to_chat_request(request)
    except APIError as e:
        raise in_dialect_terms(e, MESSAGES) from None


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
