"""Request → prompt token ids: the model's chat template for chat, text / token-id prompts for
completions. Shared by the server (engine inputs) and the router (token counts, prefix hashes)."""

from __future__ import annotations

import json

from jinja2 import TemplateError

from ferrylm.http.errors import invalid
from ferrylm.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from ferrylm.http.tool_prompt import generic_conversation, template_knows_tools
from ferrylm.request_limits import check_prompt_ids
from ferrylm.sampling_params import SamplingParamsError
from ferrylm.tokenizer import Tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Render the conversation (and its tools) with the model's own chat template and tokenize it."""
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    return render_messages(tokenizer, request.messages, tools=tools)


def render_messages(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """The token ids of `messages` through the model's chat template (a message's `name` is passed
    on, for templates that use it; tools as tool_prompt.py renders them); shared by generation and
    /tokenize, so both count alike."""
    conversation = [_message_dict(m) for m in messages]
    kwargs: dict = {}
    if template_knows_tools(getattr(tokenizer.hf, "chat_template", None)):
        kwargs = {"tools": tools} if tools else {}
        conversation = [_arguments_as_objects(m) for m in conversation]
    elif tools or any(m.tool_calls or m.role == "tool" for m in messages):
        conversation = generic_conversation(conversation, tools)
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             add_special_tokens=add_special_tokens, **kwargs)
    except (TemplateError, ValueError) as e:
        raise invalid(f"The messages could not be rendered with the chat template: {e}", "messages") from None


def _arguments_as_objects(message: dict) -> dict:
    """Tool-call arguments as objects, as transformers' chat templates expect them (OpenAI sends the
    JSON text; text that is not JSON stays as it came)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            arguments = call["function"]["arguments"]
        calls.append(call | {"function": call["function"] | {"arguments": arguments}})
    return message | {"tool_calls": calls}


def _message_dict(m: ChatMessage) -> dict:
    message: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thinking is not None:  # the name reasoning models' chat templates read (Qwen3, DeepSeek-R1)
        message["reasoning_content"] = thinking
    return message


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
