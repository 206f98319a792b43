"""Tool-call parsing and streaming (server/tools.py) and the generic tool prompt (http/tool_prompt.py),
on texts a model could write: what becomes a call, what stays content, what streams when."""

from __future__ import annotations

import copy
import json

from ferrylm.http.tool_prompt import generic_conversation
from ferrylm.server.tools import ToolPlan, ToolStream
from tests.conftest import requires_smollm2

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "add": {}}
AUTO = ToolPlan("auto", SCHEMAS, parallel=True)
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')


def test_auto_parses_blocks_and_keeps_the_text_before() -> None:
    content, calls = AUTO.parse(TEXT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2
    _, first_only = ToolPlan("auto", SCHEMAS, parallel=False).parse(TEXT)
    assert [c.function.name for c in first_only] == ["get_weather"]


def test_auto_leaves_undeclared_or_broken_calls_as_text() -> None:
    for text in ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>",
                 "plain answer"):
        assert AUTO.parse(text) == (text, [])


def test_forced_modes_parse_their_json() -> None:
    named = ToolPlan("named", SCHEMAS, True, named="get_weather")
    content, [call] = named.parse('{"city": "Oslo"}')
    assert content is None and call.function.name == "get_weather" and call.function.arguments == '{"city": "Oslo"}'
    assert named.parse('{"city": "Os') == (None, [])  # cut off: no call, and its JSON is not content
    required = ToolPlan("required", SCHEMAS, True)
    _, calls = required.parse('[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]')
    assert [c.function.name for c in calls] == ["add", "get_weather"]
    schema = json.loads(ToolPlan("required", SCHEMAS, False).constraint().json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2


def test_stream_holds_back_a_possible_tag_and_releases_text_that_is_not_one() -> None:
    stream = ToolStream(AUTO)
    head = "Let me check.\n<tool_call>\n{\"name\""
    pieces = [stream.feed(d) for d in ["Let me check.\n<to", head[len("Let me check.\n<to"):], TEXT[len(head):]]]
    assert "".join(pieces) == "Let me check.\n"
    rest, calls = stream.finish()
    assert rest == "" and [c.function.name for c in calls] == ["get_weather", "add"]
    plain = ToolStream(AUTO)
    assert plain.feed("a < b and <to") == "a < b and "
    assert plain.feed("tal") == "<total"
    assert plain.finish() == ("", [])
    forced = ToolStream(ToolPlan("named", SCHEMAS, True, named="add"))
    assert forced.feed('{"a": 1}') == "" and forced.finish()[1][0].function.arguments == '{"a": 1}'


def test_generic_conversation_renders_calls_results_and_tools() -> None:
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "3"},
    ]
    out = generic_conversation(conversation, [{"type": "function", "function": {"name": "get_weather"}}])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"].count("<tool_response>") == 2 and '"18C"' in out[3]["content"]
    assert all(set(m) <= {"role", "content", "name"} for m in out)


TOOLS_TEMPLATE = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                  "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}CALL:{{ c.function.name }}"
                  "({{ c.function.arguments.city }}){% endfor %}\n{% endfor %}")


@requires_smollm2
def test_a_template_that_knows_tools_gets_them_and_argument_objects() -> None:
    from ferrylm.http.prompt_ids import render_messages
    from ferrylm.http.protocol import ChatMessage
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("smollm2-135m"), (2,))
    tokenizer.hf = copy.copy(tokenizer.hf)
    tokenizer.hf.chat_template = TOOLS_TEMPLATE
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}]]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = tokenizer.decode(render_messages(tokenizer, messages, tools=tools), skip_special_tokens=False)
    assert text.startswith("TOOL:get_weather\nuser:Weather?assistant:CALL:get_weather(Paris)tool:18C")  # trim_blocks
    assert "<tool_call>" not in text  # the generic prompt is only for templates without tools
