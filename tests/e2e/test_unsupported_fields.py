"""Fields that would change the output but are not implemented yet (the deprecated functions /
function_call, audio, vLLM's beam search, ...) get a 400 naming the field
(code unsupported_parameter) from `ferrylm serve`, through the official openai client and raw
HTTP, and through `ferrylm gateway` (which passes bodies on); the values that ask for nothing
(response_format text, tool_choice "none", tools [], null) and unknown fields that change nothing
are still served."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_bad_input import check_error

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Say hi."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def server(_api_server_process):
    """The shared e2e server (without loading the offline reference model)."""
    _api_server_process.wait_ready()
    return _api_server_process


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def refused(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param and error["code"] == "unsupported_parameter", error
    assert f"'{param}'" in error["message"]


SDK_CASES = [  # (param, kwargs of client.chat.completions.create)
    ("functions", {"functions": [TOOL["function"]]}),
    ("function_call", {"function_call": {"name": "get_weather"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "Hi"}}),
    ("reasoning_effort", {"reasoning_effort": "high"}),
    ("web_search_options", {"web_search_options": {}}),
]


@pytest.mark.parametrize("param,kwargs", SDK_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(SDK_CASES)])
def test_openai_client_gets_bad_request_naming_the_field(client, param, kwargs):
    refused(lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs), param)


VLLM_CASES = [  # (path, extra fields, param)
    ("/v1/chat/completions", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"best_of": 2, "n": 1}, "best_of"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"bad_words": ["hi"]}, "bad_words"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": "{}"}}]}, "messages.1.function_call"),
    ("/v1/completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("/v1/completions", {"add_special_tokens": False}, "add_special_tokens"),
]


def body_for(path: str, extra: dict) -> dict:
    base = {"model": MODEL, "max_tokens": 4}
    base |= {"messages": MESSAGES} if path.endswith("chat/completions") else {"prompt": "Hi"}
    return base | extra


@pytest.mark.parametrize("path,extra,param", VLLM_CASES, ids=[c[2] + "-" + c[0].rsplit("/", 1)[1] for c in VLLM_CASES])
def test_raw_http_vllm_extras_are_refused(server, path, extra, param):
    r = httpx.post(server.url(path), json=body_for(path, extra), timeout=60)
    assert check_error(r, 400, param)["code"] == "unsupported_parameter"


def test_values_that_ask_for_nothing_are_served(client, server):
    for kwargs in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": []},
                   {"metadata": {"k": "v"}, "store": False, "parallel_tool_calls": False},
                   {"extra_body": {"guided_json": None, "use_beam_search": False, "some_unknown_field": 1}}):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, **kwargs)
        assert resp.choices[0].message.content is not None and resp.usage.completion_tokens >= 1, kwargs
    r = httpx.post(server.url("/v1/completions"), json=body_for("/v1/completions", {"add_special_tokens": True,
                                                                                     "response_format": None}),
                   timeout=60)
    assert r.status_code == 200, r.text


def test_refused_through_the_gateway(server):
    gateway = ServerProcess("--upstream", server.base_url, "--no-gateway", "--poll-interval", "60", command="gateway")
    try:
        gateway.wait_ready(60)
        refused(lambda: gateway.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, functions=[TOOL["function"]]), "functions")
        r = httpx.post(gateway.url("/v1/chat/completions"), json=body_for("/v1/chat/completions",
                                                                          {"use_beam_search": True}), timeout=60)
        assert check_error(r, 400, "use_beam_search")["code"] == "unsupported_parameter"
        # structured output passes through: a schema the backend cannot enforce is the replica's 400,
        # and a constraint it can is honoured
        r = httpx.post(gateway.url("/v1/chat/completions"), json=body_for("/v1/chat/completions", {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}),
            timeout=60)
        check_error(r, 400, "response_format")
        r = httpx.post(gateway.url("/v1/chat/completions"), json=body_for("/v1/chat/completions", {
            "structured_outputs": {"choice": ["yes", "no"]}}), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
        lone = httpx.post(gateway.url("/v1/completions"), content=b'{"model": "smollm2-135m", "prompt": "\\ud800"}',
                          headers={"content-type": "application/json"}, timeout=60)
        assert check_error(lone, 400, "prompt")
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
