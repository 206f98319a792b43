"""The Responses API request (POST /v1/responses), stateless: what it can ask for, and its
conversion to the chat request the rest of the server runs (server/responses.py shapes the answer).

Input items: messages (`role` + text content or input_text / output_text parts), `function_call`
(a call the model made earlier) and `function_call_output` (its result). Tools are function tools
(the flat `{"type": "function", "name", "parameters"}` form); `text.format` is text, json_object or
json_schema. Nothing is stored (`store` is accepted and means nothing is kept), so
`previous_response_id` and the other server-side state fields are refused with a 400 naming them.
Other fields are those of chat (vLLM's sampling extras such as top_k or stop are honoured).
"""

from __future__ import annotations

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
    JsonSchemaFormat,
    NamedToolChoice,
    NamedToolChoiceFunction,
    ResponseFormat,
    ToolCall,
)

# Responses fields that ask for server-side state or features not implemented, with the values
# that ask for nothing; any other value is a 400 naming the field.
UNSUPPORTED: dict[str, tuple] = {"previous_response_id": (), "conversation": (), "background": (False,),
                                 "include": ([],), "reasoning": ({},), "prompt": (), "truncation": ("disabled",),
                                 "max_tool_calls": (), "top_logprobs": (0,)}
# chat fields (as errors name them) → the Responses fields they came from
RESPONSES_PARAMS = {"response_format": "text.format", "response_format.json_schema": "text.format",
                    "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                    "messages": "input"}
RESPONSES = ChatDialect(("input_text", "output_text", "text"),
                        "Invalid '{where}': expected a string or a list of text parts.",
                        "Invalid '{where}[{j}]': only text parts are supported (got {kind!r}).", RESPONSES_PARAMS,
                        (("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens")))


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # json_schema: required
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")  # verbosity etc.: refused rather than ignored

    format: TextFormat | None = None


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked against UNSUPPORTED by server/responses.py

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # accepted; nothing is ever stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None  # vLLM's extra (Responses has none)


def _messages(request: ResponsesRequest) -> list[ChatMessage]:
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    messages = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise invalid(f"Invalid 'input[{i}].role': {role!r}.", f"input.{i}.role")
            content = joined_text(item.get("content", ""), f"input.{i}.content", RESPONSES)
            messages.append(ChatMessage(role=role, content=content))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid(f"Invalid 'input[{i}]': a function_call needs call_id, name and arguments.",
                              f"input.{i}")
            call = ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                last.tool_calls.append(call)  # parallel calls of one turn
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"Invalid 'input[{i}]': a function_call_output needs call_id.", f"input.{i}.call_id")
            output = joined_text(item.get("output", ""), f"input.{i}.output", RESPONSES)
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=output))
        else:
            raise invalid(f"Invalid 'input[{i}].type': {kind!r} items are not supported.", f"input.{i}.type")
    return messages


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise invalid("'text.format' of type 'json_schema' needs 'schema'.", "text.format.schema")
    if fmt.name is None:
        raise invalid("Missing required parameter: 'text.format.name'.", "text.format.name")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat.model_validate(
        {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}))


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request runs as (one choice; the same sampling, tools and
    structured output code)."""
    for name, neutral in UNSUPPORTED.items():
        value = (request.model_extra or {}).get(name)
        if value is not None and value not in neutral:
            raise invalid(f"Unsupported parameter: '{name}' is not supported by this server (responses are "
                          "stateless: nothing is stored).", name, "unsupported_parameter")
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in request.tools or []]
    choice: Any = request.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=NamedToolChoiceFunction(name=choice.name))
    # other fields go along: vLLM's sampling extras (top_k, stop, ...) are honoured, output-changing
    # ones not implemented are refused by name and the rest logged as ignored, as on chat
    extras = {k: v for k, v in (request.model_extra or {}).items() if k not in UNSUPPORTED}
    return parse_model(ChatCompletionRequest, extras | {
        "model": request.model, "messages": _messages(request), "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "stream": request.stream, "seed": request.seed,
        "user": request.user, "tools": tools or None, "tool_choice": choice,
        "parallel_tool_calls": request.parallel_tool_calls, "response_format": _response_format(request)})


def as_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """to_chat_request, its errors naming the Responses fields (what `ferrylm gateway` validates)."""
    try:
        return to_chat_request(request)
    except APIError as e:
        raise in_dialect_terms(e, RESPONSES) from None
