"""vLLM's /tokenize and /detokenize, GET /v1/models/{id} and /version against a real server process:
the ids are the model tokenizer's, a chat's count equals what a chat completion bills as prompt
tokens, and every field that would change the tokens is honoured or refused by name."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import requires_smollm2

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=server.headers(), timeout=60)


def test_tokenize_prompt_is_the_model_tokenizers_ids(api_server, llm_fp32):
    tokenizer = llm_fp32.engine.tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    r = _post(api_server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"]) > 5
    assert body["token_strs"] == tokenizer.token_strings(body["tokens"])
    assert body["max_model_len"] == llm_fp32.engine.max_model_len
    plain = _post(api_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_messages_counts_what_a_chat_completion_bills(api_server, client):
    r = _post(api_server, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    billed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert r.json()["count"] == billed
    bare = _post(api_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert bare["count"] < billed and r.json()["tokens"][:bare["count"]] == bare["tokens"]


def test_detokenize_round_trips_text(api_server):
    text = "Paris is the capital of France. 42 + 1 = 43"
    ids = _post(api_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    r = _post(api_server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400,
     "messages.0.tool_calls.0.function"),  # a tool call without its function
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_tokenizer_requests_are_openai_errors(api_server, path, body, status, param):
    r = _post(api_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_retrieve_model_and_version(api_server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"
    r = httpx.get(api_server.url("/version"), timeout=10)
    assert r.status_code == 200 and r.json()["version"]
