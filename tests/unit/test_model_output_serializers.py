"""Whatever the model emits, every parser and serializer turns it into a valid answer: a property
test drives generated text (tool-call markup with non-string names, non-object or non-finite
arguments, broken or 5,000-deep JSON, lone-surrogate escapes, control characters, tags split across
deltas) through chat, completions and Responses, streamed and not, under every tool plan. Each SSE
event and body must be strict JSON in valid UTF-8; every returned tool call names a declared tool
with object arguments; a forced tool choice never leaks its JSON into content. The engine here is a
script replaying the text as the real engine's delta outputs (the model is not what is tested)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ferrylm.http.safe_json import SafeJSONResponse
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput
from ferrylm.server import responses, serving
from ferrylm.server.fanout import Fanout
from ferrylm.server.serving import ResponseContext
from ferrylm.server.tools import MAX_PARALLEL_CALLS, ToolPlan

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
           "add": {"type": "object", "properties": {"a": {"type": "number"}}}}
PLANS = {"none": None, "auto": ToolPlan("auto", SCHEMAS, True), "auto-single": ToolPlan("auto", SCHEMAS, False),
         "required": ToolPlan("required", SCHEMAS, True), "required-single": ToolPlan("required", SCHEMAS, False),
         "named": ToolPlan("named", SCHEMAS, True, named="add")}


class _Script:
    """One request's outputs: the text cut into deltas, the last one finished."""

    def __init__(self, request_id: str, deltas: list[str], reason: FinishReason):
        self.request_id, self.deltas, self.reason = request_id, deltas, reason

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        for i, delta in enumerate(self.deltas):
            last = i == len(self.deltas) - 1
            out = CompletionOutput(0, delta, [i], self.reason if last else None, text_delta=delta,
                                   token_ids_delta=[i])
            yield RequestOutput(self.request_id, None, [1, 2, 3], [out], last)

    async def aclose(self) -> None:
        return None


class _ScriptedClient:
    def __init__(self, deltas: list[str], reason: FinishReason):
        self.deltas, self.reason = deltas, reason

    async def add_request(self, request_id, prompt, params, priority=0, output_kind=None, lora_name=None) -> _Script:
        return _Script(request_id, self.deltas, self.reason)


def _strict(text: str) -> Any:
    """json.loads that refuses what strict JSON (JavaScript's JSON.parse, serde) refuses."""
    def no_constant(name: str) -> Any:
        raise AssertionError(f"non-standard JSON constant {name}")

    text.encode("utf-8")  # raises on a lone surrogate
    return json.loads(text, parse_constant=no_constant)


def _events(stream: list[str]) -> list[dict]:
    data = [line[6:] for event in stream for line in event.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [_strict(d) for d in data[:-1]]


def _check_calls(calls: list[dict], plan: ToolPlan | None) -> None:
    assert plan is not None or not calls
    for call in calls:
        assert call["function"]["name"] in SCHEMAS
        assert isinstance(_strict(call["function"]["arguments"]), dict)
    if plan is not None and not plan.parallel:
        assert len(calls) <= 1
    assert len(calls) <= MAX_PARALLEL_CALLS


async def _run(kind: str, plan_name: str, deltas: list[str], reason: FinishReason) -> None:
    plan = PLANS[plan_name]
    fanout = Fanout(_ScriptedClient(deltas, reason), "r", [[1, 2, 3]], serving_params())
    await fanout.start()
    ctx = ResponseContext("r", "m", None, None, True, tools=plan)
    if kind == "chat-stream":
        events = _events([e async for e in serving.stream_chat(ctx, fanout)])
        content = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        calls = [t for e in events for c in e.get("choices", []) for t in c["delta"].get("tool_calls") or []]
        _check_calls(calls, plan)
        if plan is not None and plan.mode != "auto":
            assert content == ""
    elif kind == "chat":
        shaped = serving.chat_response(ctx, fanout, await serving.collect(fanout))
        body = _strict(SafeJSONResponse(shaped).body.decode())
        message = body["choices"][0]["message"]
        _check_calls(message.get("tool_calls") or [], plan)
        if plan is not None and plan.mode != "auto":
            assert message["content"] is None
    elif kind == "completion-stream":
        _events([e async for e in serving.stream_completion(ResponseContext("r", "m", None, None, True), fanout)])
    elif kind == "completion":
        finals = await serving.collect(fanout)
        _strict(SafeJSONResponse(serving.completion_response(ResponseContext("r", "m", None, None), fanout,
                                                             finals)).body.decode())
    elif kind == "responses-stream":
        events = _events([e async for e in responses.responses_streamer({})(ctx, fanout)])
        done = [e for e in events if e["type"] == "response.output_item.done"]
        _check_calls([{"function": e["item"]} for e in done if e["item"]["type"] == "function_call"], plan)
    else:
        shaped = responses.responses_shaper({})(ctx, fanout, await serving.collect(fanout))
        body = _strict(SafeJSONResponse(shaped).body.decode())
        _check_calls([{"function": i} for i in body["output"] if i["type"] == "function_call"], plan)


def serving_params():
    from ferrylm.sampling_params import SamplingParams

    return SamplingParams(max_tokens=64)


_names = st.one_of(st.sampled_from(["get_weather", "add", "launch", "ADD", ""]), st.integers(), st.none(),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                   max_size=3), max_leaves=8)
_call_json = st.builds(lambda name, args, key: json.dumps({"name": name, key: args}), _names, _values,
                       st.sampled_from(["arguments", "parameters", "args"]))
_hostile = st.sampled_from([
    '{"name": "add", "arguments": {"a": "\\ud800"}}', '{"name": "add", "arguments": {"a": NaN}}',
    '{"name": "add", "arguments": {"a": 1e999}}', '{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
    "[" * 5000, '{"name": "\\udfff", "arguments": {}}', "\x00\x01\x1b[31m\x7f", "\ufffd\u2028\u2029",
    '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}, {"name": "add", "argu',
    '{"a": 1}', '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]' * 2, "[]", "5", '"x"', "null"])
_fragment = st.one_of(_call_json, _hostile, st.text(max_size=12))
_texts = st.lists(st.one_of(_fragment, _fragment.map(lambda f: f"<tool_call>{f}</tool_call>"),
                            st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "_call>", " "])),
                  min_size=0, max_size=5).map("".join)


@given(text=_texts, data=st.data())
def test_any_model_output_becomes_a_valid_answer_on_every_endpoint(text: str, data) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    reason = data.draw(st.sampled_from([FinishReason.STOP, FinishReason.LENGTH]))
    for plan in PLANS:
        for kind in ("chat", "chat-stream", "responses", "responses-stream"):
            asyncio.run(_run(kind, plan, deltas, reason))
    for kind in ("completion", "completion-stream"):
        asyncio.run(_run(kind, "none", deltas, reason))


def test_required_keeps_the_calls_completed_before_max_tokens() -> None:
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Os'
    content, calls = PLANS["required"].parse(text)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [("add", '{"a": 1}')]
    assert PLANS["named"].parse('{"a": 1') == (None, [])  # cut off: no call, and no JSON in content
    for bad in ('{"name": ["add"], "arguments": {}}', '{"name": "add", "arguments": 5}',
                '{"name": "add", "arguments": {"a": NaN}}', '{"name": "add", "arguments": {"a": "\\ud800"}}'):
        text = f"Sure. <tool_call>{bad}</tool_call>"
        assert PLANS["auto"].parse(text) == (text, [])  # not a valid call: plain content, as vLLM's parsers do
