"""/v1/chat/completions through the openai client: greedy output equals the offline LLM's."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e import offline as offline_llm

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}],
]


def offline(llm, messages, **params):
    return offline_llm.chat(llm, [messages], **params)[0]


def prompt_len(llm, messages) -> int:
    return len(llm.get_tokenizer().apply_chat_template(offline_llm.flatten(messages)))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_greedy_matches_offline(client, llm_fp32, messages):
    expected = offline(llm_fp32, messages, temperature=0.0, max_tokens=24)
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason.value
    assert resp.usage.prompt_tokens == prompt_len(llm_fp32, messages) == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL and resp.object == "chat.completion"


def test_stream_matches_offline_with_usage(client, llm_fp32):
    messages = CONVERSATIONS[0]
    expected = offline(llm_fp32, messages, temperature=0.0, max_tokens=24)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True})
    chunks = list(raw.parse())
    assert {c.id for c in chunks} == {raw.headers["x-request-id"]}
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # one event per token, not one buffered blob
    assert "".join(c.choices[0].delta.content for c in content) == expected.outputs[0].text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [expected.outputs[0].finish_reason.value]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_event_order_and_client_request_id(api_server):
    body = {"model": MODEL, "messages": CONVERSATIONS[0], "temperature": 0, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", api_server.url("/v1/chat/completions"), json=body,
                      headers={"X-Request-Id": "my-trace-42"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "my-trace-42"
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"my-trace-42"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_n2_greedy_and_seeded(client, llm_fp32):
    messages = CONVERSATIONS[0]
    greedy = offline(llm_fp32, messages, temperature=0.0, max_tokens=12)
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, n=2)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.message.content for c in resp.choices] == [greedy.outputs[0].text] * 2
    assert resp.usage.prompt_tokens == len(greedy.prompt_token_ids)
    assert resp.usage.completion_tokens == 2 * len(greedy.outputs[0].token_ids)

    sampled = offline(llm_fp32, messages, n=2, temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    stream = client.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=0.9, top_p=0.95,
                                            seed=1234, max_tokens=12, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [o.text for o in sampled.outputs]


def test_stop_string(client, llm_fp32):
    messages = CONVERSATIONS[1]
    full = offline(llm_fp32, messages, temperature=0.0, max_tokens=24).outputs[0].text
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    expected = offline(llm_fp32, messages, temperature=0.0, max_tokens=24, stop=[stop])
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stop=stop)
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert stop not in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_logprobs_match_offline(client, llm_fp32):
    messages = CONVERSATIONS[0]
    expected = offline(llm_fp32, messages, temperature=0.0, max_tokens=4, logprobs=3)
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    out = expected.outputs[0]
    assert len(content) == len(out.token_ids)
    for entry, token_id, lps in zip(content, out.token_ids, out.logprobs):
        assert entry.logprob == pytest.approx(lps[token_id], abs=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    assert "".join(e.token for e in content) == out.text


def test_models_endpoint(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
