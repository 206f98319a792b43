"""Responses request → chat request (http/responses_protocol.py): items, instructions, tools, text.format,
the extras that go along, and the fields refused by name."""

from __future__ import annotations

import pytest

from ferrylm.http.errors import APIError
from ferrylm.http.responses_protocol import ResponsesRequest, to_chat_request


def convert(**body) -> object:
    return to_chat_request(ResponsesRequest.model_validate({"model": "m"} | body))


def test_items_become_messages() -> None:
    chat = convert(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "output_text", "text": "two"}]}])
    roles = [(m.role, m.text()) for m in chat.messages]
    assert roles == [("system", "Be brief."), ("user", "a\nb"), ("assistant", ""), ("tool", "one"), ("tool", "two")]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"]  # one turn's parallel calls
    assert [m.tool_call_id for m in chat.messages[3:]] == ["c1", "c2"]


def test_tools_format_and_extras_carry_over() -> None:
    chat = convert(input="hi", max_output_tokens=7, top_k=3, stop=["\n"],
                   tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                   tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                   text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    assert chat.max_completion_tokens == 7 and chat.top_k == 3 and chat.stop == ["\n"]
    assert chat.tools[0].function.name == "f" and chat.tool_choice.function.name == "f"
    assert chat.parallel_tool_calls is False
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.schema_ == {
        "type": "object"}
    assert convert(input="hi", text={"format": {"type": "text"}}).response_format is None


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "r"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"n": "many"}, "n"),
])
def test_refused_by_name(body: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        convert(**({"input": "hi"} | body))
    assert info.value.status == 400 and info.value.param == param
