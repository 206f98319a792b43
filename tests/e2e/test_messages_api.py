"""POST /v1/messages (Anthropic's Messages API) with the official `anthropic` SDK against real
servers: text answers equal to the chat answer of the same conversation, stop reasons, the event
stream through the SDK's own accumulator, tool use (forced and in a two-round loop, streamed too),
count_tokens, errors as the SDK's exception types in Anthropic's error shape, and `x-api-key` auth
with the audit row agreeing with the usage."""

from __future__ import annotations

import sqlite3

import anthropic
import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess, make_keys

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # Anthropic's current API has no sampling fields; older versions' are honoured


def _client(server: ServerProcess, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(api_server: ServerProcess) -> anthropic.Anthropic:
    return _client(api_server)


def test_text_answer_equals_the_chat_answer_with_usage(claude, client) -> None:
    msg = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, system="Be brief.",
                                 messages=[{"role": "user", "content": "Say hello in one sentence."}])
    chat = client.chat.completions.create(model=MODEL, extra_body=GREEDY, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello in one sentence."}])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens


def test_max_tokens_and_stop_sequences_set_the_stop_reason(claude) -> None:
    kwargs = dict(model=MODEL, extra_body=GREEDY, messages=[{"role": "user", "content": "Describe the sea at night."}])
    short = claude.messages.create(max_tokens=3, **kwargs)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    full = claude.messages.create(max_tokens=40, **kwargs).content[0].text
    word = full.split()[4]
    cut = claude.messages.create(max_tokens=40, stop_sequences=[word], **kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text and full.startswith(cut.content[0].text)


def test_stream_events_and_the_sdk_accumulator_equal_the_whole_message(claude) -> None:
    kwargs = dict(model=MODEL, max_tokens=20, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Tell me about ferries."}])
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_forced_tool_use_and_a_two_round_tool_loop(claude) -> None:
    forced = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    answer = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": forced.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 C"}]}])
    total = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert answer.content and total > forced.usage.input_tokens + forced.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens > 0  # the first round's prompt is a cached prefix
    assert all(b.type in ("text", "tool_use") for b in answer.content)
    with claude.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]


def test_output_config_format_is_structured_output(claude) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    msg = claude.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "Name a city."}],
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    import json

    value = json.loads(msg.content[0].text)
    assert set(value) == {"city"} and len(value["city"]) <= 12


def test_count_tokens_equals_the_prompt_a_message_takes(claude) -> None:
    messages = [{"role": "user", "content": "Count me, please."}]
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    msg = claude.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=messages)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 5
    with_tools = claude.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    assert with_tools.input_tokens > claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens


@pytest.mark.parametrize("extra, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0: 'image'"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"temperature": 1.5}, None),
    ({"output_config": {"effort": "high"}}, "effort"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
])
def test_what_cannot_be_honoured_is_an_anthropic_400(claude, extra, param) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert param in e.value.body["error"]["message"]


def test_missing_max_tokens_and_unknown_model_in_anthropics_shape(api_server: ServerProcess) -> None:
    r = httpx.post(api_server.url("/v1/messages"), json={"model": MODEL, "messages": ASK}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(api_server.url("/v1/messages"), json={"model": "nope", "max_tokens": 4, "messages": ASK},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(api_server.url("/v1/messages"), content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_x_api_key_authenticates_and_the_audit_row_matches_the_usage(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    keys = make_keys(url, {"messages-tenant": {}})
    server = ServerProcess("--dtype", "float32", "--require-auth", "--state-db", url)
    try:
        server.wait_ready()
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(server, "wrong-key").messages.create(model=MODEL, max_tokens=4, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
        claude = _client(server, keys["messages-tenant"])
        msg = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=ASK)
        assert msg.usage.output_tokens > 0
        with sqlite3.connect(tmp_path / "state.db") as conn:
            row = conn.execute("SELECT tenant, prompt_tokens, completion_tokens, status FROM audit_log "
                               "WHERE status = 200 ORDER BY id DESC LIMIT 1").fetchone()
        assert row == ("messages-tenant", msg.usage.input_tokens + msg.usage.cache_read_input_tokens,
                       msg.usage.output_tokens, 200)
    finally:
        server.stop()


def test_through_the_gateway_with_its_auth_limits_and_audit(tmp_path, api_server: ServerProcess) -> None:
    """`ferrylm gateway --require-auth` in front of the shared replica: x-api-key authenticates,
    the answer and the event stream come through in Anthropic's shape (the SDK's accumulator
    reassembles it), errors are Anthropic's, and the audit rows carry the usage the client saw."""
    db = tmp_path / "gw.db"
    # a tenant of its own: the gateway salts the shared replica's prefix cache per tenant name, and other
    # modules' tenants ("alpha"...) expect a cold cache there
    keys = make_keys(f"sqlite:///{db}", {"messages-tenant": {}})
    gateway = ServerProcess("--upstream", api_server.base_url, "--require-auth", "--state-db", f"sqlite:///{db}",
                            "--poll-interval", "0.25", command="gateway")
    try:
        gateway.wait_ready(60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            _client(gateway, "wrong").messages.create(model=MODEL, max_tokens=4, messages=ASK)
        assert e.value.body["type"] == "error"
        claude = _client(gateway, keys["messages-tenant"])
        with pytest.raises(anthropic.NotFoundError):
            claude.messages.create(model="nope", max_tokens=4, messages=ASK)
        kwargs = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=ASK)
        whole = claude.messages.create(**kwargs)
        with claude.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
        assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT prompt_tokens, completion_tokens, cached_tokens FROM audit_log "
                                "WHERE status = 200 ORDER BY id").fetchall()
        billed = [(whole.usage.input_tokens + whole.usage.cache_read_input_tokens, whole.usage.output_tokens),
                  (final.usage.input_tokens + final.usage.cache_read_input_tokens, final.usage.output_tokens)]
        assert [(r[0], r[1]) for r in rows] == billed, rows
        assert rows[1][2] == final.usage.cache_read_input_tokens > 0
    finally:
        gateway.stop()
