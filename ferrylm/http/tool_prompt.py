"""Tools in the prompt: the conversation handed to the chat template when a request declares tools,
made assistant `tool_calls` or sends `tool` results.

A template that knows tools (its source mentions `tools`) gets them as transformers passes them
(`tools=`, messages with `tool_calls`, role `tool`). Any other template gets the generic tool prompt
(docs/serving.md, "Tool calling"): the tool list and the call format in the system message, earlier calls as
`<tool_call>` blocks in the assistant's content, results as `<tool_response>` blocks in a user message.
server/tools.py parses the same `<tool_call>` format out of the output.
"""

from __future__ import annotations

import json
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

GENERIC_TOOL_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions are described by \
these JSON schemas:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, each a JSON object with the function's name and \
its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in str(chat_template)


def call_text(name: str, arguments: str) -> str:
    """One call in the generic format (arguments: the JSON text the client sent back)."""
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def generic_conversation(conversation: list[dict], tools: list[dict] | None) -> list[dict]:
    """`conversation` (dicts as OpenAI sends them) in plain system/user/assistant messages."""
    out: list[dict] = []
    for message in conversation:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            response = json.dumps({"tool_call_id": message.get("tool_call_id"), "content": content},
                                  ensure_ascii=False)
            if out and out[-1].get("_tool_results"):  # consecutive results share one user turn
                out[-1]["content"] += f"\n<tool_response>\n{response}\n</tool_response>"
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{response}\n</tool_response>",
                            "_tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        preamble = GENERIC_TOOL_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
