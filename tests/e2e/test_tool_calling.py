"""Tool calling end to end with the official openai client against the shared real server: forced
choices are constrained by the tool's parameter schema (arguments always validate), `auto` answers
text or a parseable call, tool results render into the next turn, streamed tool-call deltas
reassemble to the non-streamed answer, and what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

MODEL = "smollm2-135m"
CITIES = ["Paris", "London", "Tokyo", "Rome", "Lima", "Oslo", "Cairo", "Delhi", "Seoul", "Quito",
          "Dakar", "Hanoi", "Sofia", "Accra", "Minsk", "Riga", "Doha", "Kyiv", "Baku", "Bern"]


class WeatherArgs(BaseModel):
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class AddArgs(BaseModel):
    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


def _tool(name: str, description: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": model.model_json_schema()}}


TOOLS = [_tool("get_weather", "Current weather in a city", WeatherArgs), _tool("add", "Add two integers", AddArgs)]
ARGS = {"get_weather": WeatherArgs, "add": AddArgs}


def _weather(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city} right now?"}]


def test_named_tool_choice_arguments_validate_20_of_20(api_server: ServerProcess) -> None:
    client = api_server.async_client()
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def run():
        return await asyncio.gather(*[client.chat.completions.create(
            model=MODEL, messages=_weather(city), tools=TOOLS, tool_choice=named, temperature=0, max_tokens=60)
            for city in CITIES])

    for r in asyncio.run(run()):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        WeatherArgs.model_validate_json(call.function.arguments)


def test_required_tool_choice_returns_a_valid_call(client) -> None:
    for city in CITIES[:4]:
        r = client.chat.completions.create(model=MODEL, messages=_weather(city), tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        ARGS[call.function.name].model_validate_json(call.function.arguments)


def test_auto_answers_text_or_a_parseable_call(client) -> None:
    for city in CITIES[:3]:
        r = client.chat.completions.create(model=MODEL, messages=_weather(city), tools=TOOLS, temperature=0,
                                           max_tokens=40)
        message = r.choices[0].message
        if message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            for call in message.tool_calls:
                ARGS[call.function.name].model_validate_json(call.function.arguments)
        else:
            assert message.content


def test_tool_result_turn_is_rendered_and_answered(client) -> None:
    first = client.chat.completions.create(model=MODEL, messages=_weather("Paris"), tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    turn = [*_weather("Paris"), {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=30)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    without = client.chat.completions.create(model=MODEL, messages=turn[:1], tools=TOOLS, tool_choice="none",
                                             temperature=0, max_tokens=1)
    assert r.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the call and its result are in the prompt


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "add"}}, "required"])
def test_streamed_tool_call_deltas_reassemble(client, tool_choice) -> None:
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    kwargs = dict(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons == ["tool_calls"] == [whole.finish_reason]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18"}]}, "messages.1.tool_call_id"),
    # OpenAI's own 400s: a result for a call never made, arguments that are not JSON text, a nameless schema
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "18"}]},
     "messages.1.tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Oslo"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18"}]}, "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
])
def test_tool_requests_that_cannot_be_honoured_are_400(api_server: ServerProcess, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8} | extra
    r = httpx.post(f"{api_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
