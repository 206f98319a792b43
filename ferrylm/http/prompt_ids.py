"""Request → prompt token ids: the model's chat template for chat, text / token-id prompts for
completions. Shared by the server (engine inputs) and the router (token counts, prefix hashes)."""

from __future__ import annotations

from jinja2 import TemplateError

from ferrylm.http.errors import invalid
from ferrylm.http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from ferrylm.request_limits import check_prompt_ids
from ferrylm.sampling_params import SamplingParamsError
from ferrylm.tokenizer import Tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    """Render the conversation with the model's own chat template and tokenize it."""
    return render_messages(tokenizer, request.messages)


def render_messages(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
    """The token ids of `messages` through the model's chat template (a message's `name` is passed
    on, for templates that use it); shared by generation and /tokenize, so both count alike."""
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    | ({"name": m.name} if m.name is not None else {}) for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             add_special_tokens=add_special_tokens)
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
