"""Extreme but valid sampling parameters on a real server (issue M2.1 item 2): never a 500.

repetition_penalty 1e-300 used to reach float32 as 0 (logits / 0 = inf, then NaN): non-streaming
logprobs made the JSON encoder raise (500), streaming sent `"logprob": null` and garbage tokens.
Non-finite values a client can spell in JSON (NaN, Infinity) get a 400 naming the field.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.test_bad_input import assert_still_serving, check_error

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PENALTIES = [1e-300, 1e-40, 1e39]


def chat_body(**overrides) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello hello hello."}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": 5}
    return body | overrides


def completion_body(**overrides) -> dict:
    return {"model": MODEL, "prompt": "The cat sat on the mat. The cat", "max_tokens": 4, "logprobs": 5} | overrides


def finite(value: object) -> bool:
    """A JSON logprob that is a real number (json.loads turns NaN/Infinity into floats, null into None)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_chat_logprobs(logprobs: dict) -> int:
    for entry in logprobs["content"]:
        assert finite(entry["logprob"]), entry
        assert len(entry["top_logprobs"]) == 5 and all(finite(t["logprob"]) for t in entry["top_logprobs"]), entry
    return len(logprobs["content"])


def check_completion_logprobs(logprobs: dict) -> int:
    assert all(finite(v) for v in logprobs["token_logprobs"]), logprobs
    for top in logprobs["top_logprobs"]:
        assert top and all(finite(v) for v in top.values()), logprobs
    return len(logprobs["token_logprobs"])


def post(api_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(api_server.url(path), json=body, timeout=120)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("penalty", PENALTIES)
def test_extreme_repetition_penalty_chat_logprobs_are_finite(api_server, penalty, temperature):
    r = post(api_server, CHAT, chat_body(repetition_penalty=penalty, temperature=temperature, seed=3))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert check_chat_logprobs(choice["logprobs"]) == r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("penalty", PENALTIES)
def test_extreme_repetition_penalty_completion_logprobs_are_finite(api_server, penalty):
    r = post(api_server, COMPLETIONS, completion_body(repetition_penalty=penalty, temperature=0.7, seed=4))
    assert r.status_code == 200, r.text
    body = r.json()
    assert check_completion_logprobs(body["choices"][0]["logprobs"]) == body["usage"]["completion_tokens"] >= 1


def sse_events(api_server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", api_server.url(path), json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_extreme_repetition_penalty_streaming_logprobs_are_finite(api_server, path):
    body = (chat_body if path == CHAT else completion_body)(repetition_penalty=1e-300, temperature=0.0)
    events = sse_events(api_server, path, body)
    check = check_chat_logprobs if path == CHAT else check_completion_logprobs
    tokens = sum(check(c["logprobs"]) for e in events for c in e["choices"] if c.get("logprobs"))
    assert tokens >= 1


def test_extreme_repetition_penalty_stream_matches_non_stream(api_server):
    # Greedy with a vanishing penalty is deterministic: streaming must not produce other (garbage) tokens.
    body = completion_body(repetition_penalty=1e-300, temperature=0.0, logprobs=None)
    text = post(api_server, COMPLETIONS, body).json()["choices"][0]["text"]
    streamed = "".join(c["text"] for e in sse_events(api_server, COMPLETIONS, body) for c in e["choices"])
    assert streamed == text


RAW_CASES = [  # (name, path, raw JSON body, param)
    ("temperature NaN", CHAT, b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], '
                              b'"temperature": NaN}', "temperature"),
    ("repetition_penalty Infinity", CHAT, b'{"model": "smollm2-135m", "messages": [{"role": "user", '
                                          b'"content": "Hi"}], "repetition_penalty": Infinity}',
     "repetition_penalty"),
    ("repetition_penalty NaN", COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "Hi", '
                                            b'"repetition_penalty": NaN}', "repetition_penalty"),
    ("logit_bias NaN", CHAT, b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], '
                             b'"logit_bias": {"42": NaN}}', "logit_bias"),
    ("top_p NaN", COMPLETIONS, b'{"model": "smollm2-135m", "prompt": "Hi", "top_p": NaN}', "top_p"),
]


@pytest.mark.parametrize("name,path,body,param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_non_finite_json_numbers_get_400_naming_the_param(api_server, client, name, path, body, param):
    r = httpx.post(api_server.url(path), content=body, headers={"content-type": "application/json"}, timeout=60)
    check_error(r, 400, param)
    assert_still_serving(client)
