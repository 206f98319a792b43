"""Bad requests get OpenAI-style errors with OpenAI's status codes, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import requires_smollm2

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"


def chat_body(**overrides) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    body.update(overrides)
    return body


CASES = [  # (name, path, raw body or dict, status, param)
    ("malformed json", CHAT, b'{"model": "smollm2-135m", "messages": [', 400, None),
    ("invalid utf-8", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, chat_body(messages=[]), 400, "messages"),
    ("bad role", CHAT, chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("user content null", CHAT, chat_body(messages=[{"role": "user", "content": None}]), 400, "messages.0.content"),
    ("system content missing", CHAT, chat_body(messages=[{"role": "system"}, {"role": "user", "content": "x"}]), 400,
     "messages.0.content"),
    ("tokenize user content null", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": None}]},
     400, "messages.0.content"),
    ("temperature -1", CHAT, chat_body(temperature=-1), 400, "temperature"),
    ("temperature type", CHAT, chat_body(temperature="hot"), 400, "temperature"),
    ("max_tokens 0", CHAT, chat_body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens 1e9", CHAT, chat_body(max_tokens=10 ** 9), 400, "max_tokens"),
    ("n 0", CHAT, chat_body(n=0), 400, "n"),
    ("unknown model", CHAT, chat_body(model="gpt-4o"), 404, "model"),
    ("prompt over context", CHAT, chat_body(messages=[{"role": "user", "content": "hello " * 9000}]), 400,
     "messages"),
    ("logit_bias out of vocab", CHAT, chat_body(logit_bias={"1000000": 5}), 400, "logit_bias"),
    ("logit_bias value", CHAT, chat_body(logit_bias={"42": 500}), 400, "logit_bias"),
    ("stream_options without stream", CHAT, chat_body(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("completion token out of vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10 ** 7]}, 400,
     "prompt"),
    ("completion empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
]


def assert_still_serving(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          temperature=0, max_tokens=3)
    assert resp.choices[0].message.content and resp.usage.completion_tokens == 3


def check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert r.headers["x-request-id"]
    return error


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(api_server, client, name, path, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(api_server.url(path), timeout=60, **kwargs)
    error = check_error(r, status, param)
    if name == "unknown model":
        assert error["code"] == "model_not_found"
    if name in ("prompt over context", "max_tokens 1e9"):
        assert error["code"] == "context_length_exceeded"
    assert_still_serving(client)


def test_ten_megabyte_body(api_server, client):
    r = httpx.post(api_server.url(CHAT), content=b'{"pad": "' + b"x" * (10 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert check_error(r, 413, None)["code"] == "request_too_large"
    assert_still_serving(client)


def test_unknown_route_and_method(api_server):
    check_error(httpx.get(api_server.url("/v1/nope"), timeout=10), 404, None)
    r = httpx.get(api_server.url(CHAT), timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_openai_client_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
