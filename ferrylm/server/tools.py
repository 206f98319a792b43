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
        is the tools' fault)."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=json.dumps(self.schemas[self.named]), param="tools")
        if self.mode == "required":
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                               "required": ["name", "arguments"]} for name, schema in self.schemas.items()]}
            array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=json.dumps(array), param="tools")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output; text that holds no valid call stays content."""
        if self.mode == "named":
            assert self.named is not None
            calls = [_call(self.named, text)] if _is_json(text) else []
            return (None, calls) if calls else (text, [])
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            calls = [_call(item["name"], json.dumps(item["arguments"], ensure_ascii=False)) for item in items
                     if isinstance(item, dict) and item.get("name") in self.schemas and "arguments" in item]
            return (None, calls) if calls else (text, [])
        calls = []
        for block in _BLOCK.findall(text):
            try:
                item = json.loads(block)
            except json.JSONDecodeError:
                continue
            if isinstance(item, dict) and item.get("name") in self.schemas:
                arguments = item.get("arguments", item.get("parameters", {}))
                calls.append(_call(item["name"], json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[:text.index(CALL_OPEN)].strip()
        return content or None, calls if self.parallel else calls[:1]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


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
        """(content not yet streamed, calls) once the choice finished."""
        _, calls = self.plan.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        end = self.text.find(CALL_OPEN) if self.plan.mode == "auto" else 0
        return self.text[self.sent:max(end, self.sent)].rstrip(), calls


def call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed shape of `calls`: one delta per call, whole arguments in it."""
    return [{"index": i, "id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}} for i, c in enumerate(calls)]
