"""Malformed JSON that decodes, or nearly: nesting 10^5 deep (json.loads raises RecursionError) or
deeper than the body's bound of 128 levels, and lone UTF-16 surrogates ("\\ud800" decodes to a str
that cannot be encoded as UTF-8) get a 400 from `ferrylm serve`, never a 500, naming the field that
holds the surrogate; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from ferrylm.http.body import MAX_JSON_DEPTH
from tests.conftest import requires_smollm2
from tests.e2e.test_bad_input import assert_still_serving, check_error

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CHAT_HEAD = b'{"model": "smollm2-135m", "max_tokens": 2, '
COMPLETION_HEAD = b'{"model": "smollm2-135m", "max_tokens": 2, '


@pytest.fixture(scope="module")
def server(_api_server_process):
    """The shared e2e server (without loading the offline reference model)."""
    _api_server_process.wait_ready()
    return _api_server_process


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def post(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url(path), content=raw, headers={"content-type": "application/json"}, timeout=60)


DEEP = [  # (name, path, raw body)
    ("chat 1e5 deep messages", CHAT, CHAT_HEAD + b'"messages": ' + nested(100_000) + b"}"),
    ("chat 1e5 deep object", CHAT, b'{"a": ' * 100_000 + b"1" + b"}" * 100_000),
    ("chat past the bound", CHAT, CHAT_HEAD + b'"messages": [{"role": "user", "content": "hi"}], "metadata": '
     + nested(MAX_JSON_DEPTH) + b"}"),
    ("completion 1e5 deep prompt", COMPLETIONS, COMPLETION_HEAD + b'"prompt": ' + nested(100_000) + b"}"),
    ("completion past the bound", COMPLETIONS, COMPLETION_HEAD + b'"prompt": ' + nested(MAX_JSON_DEPTH + 5) + b"}"),
]


@pytest.mark.parametrize("name,path,raw", DEEP, ids=[c[0] for c in DEEP])
def test_deeply_nested_json_is_a_400(server, name, path, raw):
    error = check_error(post(server, path, raw), 400, None)
    assert f"nested more than {MAX_JSON_DEPTH} levels" in error["message"]
    assert_still_serving(server.client())


def test_nesting_within_the_bound_is_served(server):
    # An ignored field nested to the bound (the body object is level 1) does not stop the request.
    raw = (CHAT_HEAD + b'"messages": [{"role": "user", "content": "hi"}], "metadata": '
           + nested(MAX_JSON_DEPTH - 1) + b"}")
    r = post(server, CHAT, raw)
    assert r.status_code == 200, r.text


SURROGATES = [  # (name, path, raw body, param)
    ("chat content", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "a\ud800b"}]}',
     "messages.0.content"),
    ("chat low surrogate", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "\udc00"}]}',
     "messages.0.content"),
    ("chat second message", CHAT, CHAT_HEAD + rb'"messages": [{"role": "system", "content": "ok"}, '
     rb'{"role": "user", "content": "x\uDBFF"}]}', "messages.1.content"),
    ("chat text part", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": [{"type": "text", '
     rb'"text": "\ud800"}]}]}', "messages.0.content.0.text"),
    ("chat stop", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"}',
     "stop"),
    ("chat model", CHAT, rb'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("chat unknown field", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}',
     "user"),
    ("chat key", CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "hi"}], "\ud800": 1}', None),
    ("completion prompt", COMPLETIONS, COMPLETION_HEAD + rb'"prompt": "\ud800"}', "prompt"),
    ("completion prompt list", COMPLETIONS, COMPLETION_HEAD + rb'"prompt": ["ok", "\udfff"]}', "prompt.1"),
]


@pytest.mark.parametrize("name,path,raw,param", SURROGATES, ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_is_a_400_naming_the_field(server, name, path, raw, param):
    error = check_error(post(server, path, raw), 400, param)
    assert "lone UTF-16 surrogate" in error["message"]
    assert_still_serving(server.client())


@pytest.mark.parametrize("path,raw", [
    (CHAT, CHAT_HEAD + rb'"messages": [{"role": "user", "content": "smile \ud83d\ude00"}]}'),
    (COMPLETIONS, COMPLETION_HEAD + rb'"prompt": "smile \uD83D\uDE00 \\ud800 is text here"}'),
], ids=["chat", "completion"])
def test_surrogate_pairs_and_escaped_backslashes_are_served(server, path, raw):
    r = post(server, path, raw)
    assert r.status_code == 200, r.text
