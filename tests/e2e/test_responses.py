"""POST /v1/responses with the official openai client against the shared real server: text and
message-list input, instructions, max_output_tokens, the streamed event sequence, structured output
through text.format (responses.parse), function tools and their result items, stateless 400s."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}}]


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_text_input_with_instructions_equals_the_chat_answer(client) -> None:
    r = client.responses.create(model=MODEL, input="Say hello in one sentence.", instructions="Be brief.",
                                max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in one sentence."}])
    assert r.object == "response" and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.instructions == "Be brief." and r.max_output_tokens == 24 and r.store is False


def test_message_list_input_and_max_output_tokens(client) -> None:
    r = client.responses.create(model=MODEL, max_output_tokens=3, temperature=0, input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text


def test_stream_events_reassemble_to_the_whole_response(client) -> None:
    kwargs = dict(model=MODEL, input="Tell me about the sea.", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_structured_output_through_text_format(client) -> None:
    r = client.responses.parse(model=MODEL, input="Name a famous city.", text_format=City, max_output_tokens=80,
                               temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, City)


def test_function_tools_calls_and_results(client) -> None:
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    follow = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=TOOLS, tool_choice="none", temperature=0,
                                     max_output_tokens=10)
    assert answer.output_text and answer.usage.input_tokens > r.usage.input_tokens + 20
    events = list(client.responses.create(model=MODEL, input="What is the weather in Rome?", tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                                          max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and set(json.loads(done[0].arguments)) == {"city"}
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}}, "text.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_what_cannot_be_honoured_is_a_400(api_server: ServerProcess, body: dict, param: str) -> None:
    r = httpx.post(f"{api_server.base_url}/v1/responses", json={"model": MODEL, "input": "hi",
                                                                 "max_output_tokens": 4} | body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
