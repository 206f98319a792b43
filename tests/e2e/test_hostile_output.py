"""Model output never becomes a 5xx, on a real `ferrylm serve` with the real model: a client forces
the model (a regex constraint beside `tools`) to emit tool-call markup no parser should trust — a
non-string name, non-object or non-finite arguments, a lone-surrogate escape, control characters,
deep nesting — and gets a 200 whose content is that text, no tool call, valid JSON in every body
and SSE event; `tool_choice: "required"` with the openai SDK returns its calls as `tool_calls`."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
HOSTILE = [
    '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": 5}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": "\\ud800"}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": ' + "[" * 40 + "]" * 40 + "}</tool_call>",
]


@pytest.fixture(scope="module")
def server(api_server: ServerProcess) -> ServerProcess:
    return api_server  # the shared session server (float32): no server start of its own


def _strict(text: str):
    def refuse(name: str):
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("markup", HOSTILE)
def test_forced_hostile_markup_is_plain_content(server, markup):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Add one."}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 200, "guided_regex": re.escape(markup)}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = _strict(r.content.decode("utf-8"))["choices"][0]["message"]
    assert message["content"] == markup and not message.get("tool_calls")
    if markup not in HOSTILE[:2]:
        return  # streamed and Responses shaping run the same parser: two markups suffice there (CI time)
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body | {"stream": True}, timeout=120) as s:
        assert s.status_code == 200
        data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    events = [_strict(d) for d in data[:-1]]
    assert data[-1] == "[DONE]" and not any("error" in e for e in events)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == markup
    r = httpx.post(server.url("/v1/responses"), timeout=120, json={
        "model": MODEL, "input": "Add one.", "tools": [{"type": "function", **TOOLS[0]["function"]}],
        "temperature": 0, "max_output_tokens": 200, "guided_regex": re.escape(markup)})
    assert r.status_code == 200 and _strict(r.text)["output"][0]["type"] == "message"


def test_control_characters_in_a_valid_call_stay_valid_json(server):
    markup = '<tool_call>{"name": "add", "arguments": {"a": "\\u0000\\u001b"}}</tool_call>'
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Add one."}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 200, "guided_regex": re.escape(markup)}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert r.status_code == 200
    [call] = _strict(r.content.decode("utf-8"))["choices"][0]["message"]["tool_calls"]
    assert _strict(call["function"]["arguments"]) == {"a": "\x00\x1b"}


def test_required_returns_tool_calls_with_the_openai_sdk(server):
    client = server.client()
    for parallel in (False, True):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add 2."}],
                                               tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
                                               parallel_tool_calls=parallel)
        message = reply.choices[0].message
        assert message.content is None and message.tool_calls
        assert all(c.function.name == "add" and isinstance(json.loads(c.function.arguments)["a"], int)
                   for c in message.tool_calls)
        assert len(message.tool_calls) == 1 if not parallel else 1 <= len(message.tool_calls) <= 8
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Add 2."}],
                                         tools=TOOLS, tool_choice="required", temperature=0, max_tokens=14)
    assert cut.choices[0].message.content is None  # cut off mid-call: its JSON never becomes content
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
