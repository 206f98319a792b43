"""OpenAI API schemas (chat completions, completions, models) plus vLLM's sampling extras.

Requests keep unknown fields (extra="allow", in `model_extra`) rather than dropping them:
inputs.check_supported refuses with a 400 naming the field every known OpenAI or vLLM field that
would change the output but is not implemented (response_format, tools, guided_json, ...), and
logs the rest as ignored, as vLLM does. Ranges OpenAI documents are checked here so the error
names the field; everything else is checked when SamplingParams is built.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

FinishReasonStr = Literal["stop", "length", "abort", "tool_calls"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's continuous_usage_stats is refused, not dropped

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema is enforced whether or not `strict` is set."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # required, as OpenAI has it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model_config = ConfigDict(extra="allow")  # unknown fields: see the module docstring

    model: str | None = None  # None: the first served model (vLLM's behaviour)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)  # None, 0 or -1: off (vLLM refuses below -1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    priority: int | None = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # structured output (server/structured.py): OpenAI's response_format, vLLM's structured_outputs
    # (json, regex, choice, grammar, json_object, disable_any_whitespace) and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # FerryLM's extension (off by default; OpenAI has no such field): llama.cpp's `timings` object, with
    # queue and TTFT, in the response (or a stream's last chunk before [DONE])
    timings: bool | None = False


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class ChatMessage(BaseModel):
    """A message of the conversation; content may be a string or a list of text parts. An assistant
    message may carry the `tool_calls` it made, a `tool` message the result of one (`tool_call_id`)."""

    model_config = ConfigDict(extra="allow")  # audio...: refused by inputs.check_supported

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier turn's thinking sent back (vLLM's current name, or the older one): kept in the prompt
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: True (OpenAI's default)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (echo + logprobs), no token
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt token, top-k + rank
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # --reasoning-parser: output tokens of the thinking


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with --reasoning-parser (else left out)

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler: Any) -> dict:
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k != "completion_tokens_details"}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (no context)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprobEntry(BaseModel):
    """vLLM's shape of one token in a prompt position's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # --reasoning-parser: the thinking, under vLLM's current name and its older one (left out when None)
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_reasoning(self, handler: Any) -> dict:
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k not in ("reasoning", "reasoning_content")}


class DeltaMessage(BaseModel):
    """A streamed delta; absent fields are left out, as OpenAI does (`{}` in the finish chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's tool-call deltas (index, id, type, function)
    reasoning: str | None = None  # --reasoning-parser: thinking deltas (and under the older name)
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr | None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonStr | None = None
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = None  # vLLM's, when asked


def _now() -> int:
    return int(time.time())


Timings = dict[str, float | int | None]  # llama.cpp's names (observability/request_timeline.py)


def _timings_field() -> Any:
    """`timings`, present only when the request asked for them (`"timings": true`)."""
    return Field(None, exclude_if=lambda value: value is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    timings: Timings | None = _timings_field()


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = _timings_field()


class CompletionResponse(BaseModel):
    """Both the whole /v1/completions answer and each streamed `text_completion` chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: Timings | None = _timings_field()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "ferrylm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer endpoints ----------------------------------------------------------------
class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a text `prompt`, or chat `messages` rendered with the model's
    chat template. Unknown fields are refused (extra="forbid"): each of vLLM's others (chat_template,
    tools, ...) would change the tokens."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids back to text, special tokens kept."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
