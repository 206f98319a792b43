"""Tool calling: `tools` / `tool_choice` / `parallel_tool_calls` → what the output is constrained to,
and the output → OpenAI `tool_calls` (whole, or as streamed deltas).

- `auto` (the default with tools): free text; `<tool_call>{"name", "arguments"}</tool_call>` blocks
  in it (the format the generic tool prompt asks for, http/tool_prompt.py) become tool calls.
- `required`: the output is a JSON array of `{"name", "arguments"}` constrained by every tool's
  parameter schema (one item when `parallel_tool_calls` is false), so arguments always validate.
- a named function: the output is that function's arguments, constrained by its schema.
- `none`: plain text (the tools stay in the prompt, as vLLM does by default).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ferrylm.http.errors import invalid
from ferrylm.http.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from ferrylm.http.tool_prompt import CALL_CLOSE, CALL_OPEN
from ferrylm.sampling_params import StructuredOutputsParams

_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    schemas: dict[str, dict[str, Any]]  # tool name → its parameters schema
    parallel: bool
    named: str | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar a forced choice generates under (param "tools": a schema that cannot compile
        is the tools' fault). `required` allows one call unless `parallel_tool_calls`, then at most
        MAX_PARALLEL_CALLS (a model repeating its call stops there instead of at max_tokens)."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=json.dumps(self.schemas[self.named]), param="tools")
        if self.mode == "required":
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                               "required": ["name", "arguments"]} for name, schema in self.schemas.items()]}
            array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1,
                                     "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}
            return StructuredOutputsParams(json=json.dumps(array), param="tools")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output, whatever the model emitted: markup that is not
        a valid call (a name that is not a declared tool, arguments that are not an object, broken or
        too deeply nested JSON) stays plain content in `auto`, as vLLM's parsers do. A forced choice
        never puts its JSON in content; cut off at max_tokens, it keeps the calls completed so far."""
        if self.mode == "named":
            assert self.named is not None
            value = _loads(text)
            arguments = _arguments(value) if isinstance(value, dict) else None
            return None, [_call(self.named, arguments)] if arguments is not None else []
        if self.mode == "required":
            calls = [c for c in (self._valid_call(item) for item in _complete_items(text)) if c is not None]
            return None, calls[:MAX_PARALLEL_CALLS if self.parallel else 1]
        calls = []
        for block in _BLOCK.findall(text):
            call = self._valid_call(_loads(block), auto=True)
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = text[:text.index(CALL_OPEN)].strip()
        return content or None, calls if self.parallel else calls[:1]

    def _valid_call(self, item: Any, auto: bool = False) -> ToolCall | None:
        """A ToolCall if `item` is {"name": <a declared tool>, "arguments": {...}} (in `auto` the
        generic prompt's "parameters" is read too, and no arguments mean {})."""
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or item["name"] not in self.schemas:
            return None
        value = item.get("arguments", item.get("parameters", {})) if auto else item.get("arguments")
        arguments = _arguments(value) if isinstance(value, dict) else None
        return _call(item["name"], arguments) if arguments is not None else None


MAX_PARALLEL_CALLS = 8  # the most calls one `required` choice may make with parallel_tool_calls


def _loads(text: str) -> Any:
    """The JSON value of `text`, or None for anything that is not one (nesting too deep included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _arguments(value: dict) -> str | None:
    """`value` as the arguments string of a call, strict JSON in valid UTF-8; None (not a call) for
    what strict JSON cannot hold: NaN or infinity, or a lone surrogate the model wrote as an escape."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
        return text
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None


def _complete_items(text: str) -> list[Any]:
    """The complete items of a JSON array, even if the array itself was cut off (max_tokens)."""
    decoder, items = json.JSONDecoder(), list[Any]()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        return []
    i += 1
    while True:
        i = _skip_space(text, i)
        try:
            item, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return items
        items.append(item)
        i = _skip_space(text, i)
        if not text.startswith(",", i):
            return items
        i += 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=arguments))


def plan(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tool calling), or a 400 naming the field at fault."""
    tools, choice = request.tools or [], request.tool_choice
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in schemas:
            raise invalid(f"Invalid 'tools[{i}]': the function name {name!r} is declared twice.", "tools")
        schemas[name] = tool.function.parameters or _NO_ARGUMENTS
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise invalid("'tool_choice' needs 'tools'.", "tool_choice")
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, str):
        return ToolPlan(choice, schemas, parallel)
    if choice.function.name not in schemas:
        raise invalid(f"Invalid 'tool_choice': the function {choice.function.name!r} is not among 'tools'.",
                      "tool_choice")
    return ToolPlan("named", schemas, parallel, named=choice.function.name)


class ToolStream:
    """One streamed choice under a tool plan: which content may go out now, and the calls at the end.

    Forced modes stream no content (the output is the call). `auto` streams text until a `<tool_call>`
    may begin, then holds the rest until the end, when it is parsed."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.plan.mode != "auto":
            return ""
        start = self.text.find(CALL_OPEN)
        safe = len(self.text) if start < 0 else start
        if start < 0:  # hold back a suffix that could be the beginning of the tag
            for k in range(min(len(CALL_OPEN) - 1, len(self.text)), 0, -1):
                if CALL_OPEN.startswith(self.text[-k:]):
                    safe = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent:max(safe, self.sent)], max(safe, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, calls) once the choice finished: what `parse` makes of the
        whole text, less what was streamed already (a forced choice streams and returns no content)."""
        content, calls = self.plan.parse(self.text)
        if self.plan.mode != "auto":
            return "", calls
        if not calls:
            return self.text[self.sent:], []
        end = self.text.find(CALL_OPEN)
        return self.text[self.sent:max(end, self.sent)].rstrip(), calls


def call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed shape of `calls`: one delta per call, whole arguments in it."""
    return [{"index": i, "id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}} for i, c in enumerate(calls)]
