"""Structured output end to end: the official openai client against the shared real server.

Every string, array and integer in the schemas is bounded, so any output the grammar allows ends
within max_tokens: a truncated (finish_reason length) answer would be a failure, not bad luck.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, Field

from tests.e2e.server_process import ServerProcess

MODEL = "smollm2-135m"
Short = Annotated[str, Field(max_length=16)]


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: Short
    zip_code: Annotated[str, Field(max_length=6)] | None = None


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    favourite_color: Color
    hobbies: list[Short] = Field(max_length=2)
    address: Address
    nickname: Annotated[str, Field(max_length=10)] | None = None


def _ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Invent character number {i} for a story and describe them."}]


def test_parse_pydantic_20_of_20(api_server: ServerProcess) -> None:
    """client.chat.completions.parse with nested models, an enum, arrays and optional fields."""
    client = api_server.async_client()

    async def one(i: int):
        r = await client.chat.completions.parse(model=MODEL, messages=_ask(i), response_format=Person,
                                                temperature=0, max_tokens=300)
        return r.choices[0]

    async def run():
        return await asyncio.gather(*[one(i) for i in range(20)])

    choices = asyncio.run(run())
    assert [c.finish_reason for c in choices] == ["stop"] * 20
    for choice in choices:
        assert isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    assert len({c.message.content for c in choices}) > 1  # the prompts differ, so should the answers


def test_json_object_parses(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_ask(0), response_format={"type": "json_object"},
                                       temperature=0, max_tokens=80)
    content = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":  # an object the model ends by itself
        assert isinstance(json.loads(content), dict)
    else:  # an object the model keeps extending: still a JSON object so far
        assert content.startswith("{")


def test_regex_and_choice_match(client) -> None:
    pattern = r"(yes|no), because [a-z ]{1,20}\."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sea blue?"}],
                                       temperature=0, max_tokens=60, extra_body={"structured_outputs": {
                                           "regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    choices = ["sunny", "rainy", "it says \"maybe\""]
    r = client.completions.create(model=MODEL, prompt="The weather tomorrow will be", temperature=0.8, seed=3, n=4,
                                  max_tokens=20, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices), r.choices
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}],
                                       temperature=0, max_tokens=20, extra_body={"guided_choice": ["red", "blue"]})
    assert r.choices[0].message.content in ("red", "blue")


def test_ebnf_grammar(client) -> None:
    grammar = 'root ::= "Answer: " [0-9] [0-9]? " apples"'
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "How many apples?"}],
                                       temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"Answer: [0-9][0-9]? apples", r.choices[0].message.content)


def test_streamed_schema_output_joins_to_valid_json(client) -> None:
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL, messages=_ask(7), temperature=0, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert Person.model_validate_json(text)
    whole = client.chat.completions.create(
        model=MODEL, messages=_ask(7), temperature=0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert whole.choices[0].message.content == text


@pytest.mark.parametrize(("body", "param", "fragment"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, "response_format", "'not'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "EBNF"),
    ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "structured_outputs", "no finite output"),
    ({"guided_grammar": 'root ::= x "."\nx ::= "(" x ")"'}, "guided_grammar", "no finite output"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " *", "regex": "a"}}, "structured_outputs.whitespace_pattern",
     "whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "Only one"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 5}, "min_tokens", "structured output"),
    ({"guided_json": {"type": "object"}, "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "xgrammar"),
])
def test_constraint_that_cannot_be_enforced_is_a_400(api_server: ServerProcess, body: dict, param: str,
                                                     fragment: str) -> None:
    r = httpx.post(f"{api_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    # the engine is unharmed: a guided request right after still works
    ok = httpx.post(f"{api_server.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Say", "max_tokens": 5, "structured_outputs": {"choice": ["a", "b"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a", "b")
