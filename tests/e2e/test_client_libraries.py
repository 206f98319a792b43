"""Frameworks users build on, unmodified, against the shared real server: langchain-openai's
`with_structured_output` and `bind_tools`, and litellm's `openai/` provider (plain, streamed, tools)."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

MODEL = "smollm2-135m"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=99)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def chat_model(api_server: ServerProcess):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=f"{api_server.base_url}/v1", api_key="unused", model=MODEL,
                                       temperature=0, max_tokens=120, max_retries=0, timeout=120)


def test_langchain_with_structured_output(chat_model) -> None:
    for method in ("json_schema", "function_calling"):  # response_format json_schema; a forced tool call
        structured = chat_model.with_structured_output(City, method=method)
        prompt = "Name a large city as JSON with name, country and population_millions."
        city = structured.invoke(prompt)
        assert isinstance(city, City), (method, city)


def test_langchain_bind_tools(chat_model) -> None:
    bound = chat_model.bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"]
    GetWeather.model_validate(call["args"])
    auto = chat_model.bind_tools([GetWeather]).invoke("Say hello.")
    assert auto.content or auto.tool_calls


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    return pytest.importorskip("litellm")


def test_litellm_openai_provider(litellm, api_server: ServerProcess) -> None:
    common = dict(model=f"openai/{MODEL}", api_base=f"{api_server.base_url}/v1", api_key="unused", temperature=0,
                  max_tokens=16)
    messages = [{"role": "user", "content": "Say hello."}]
    whole = litellm.completion(messages=messages, **common)
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       litellm.completion(messages=messages, stream=True, **common))
    assert streamed == whole.choices[0].message.content
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": GetWeather.model_json_schema()}}
    called = litellm.completion(messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[tool],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                **common | {"max_tokens": 60})
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and called.choices[0].finish_reason == "tool_calls"
    GetWeather.model_validate_json(call.function.arguments)
