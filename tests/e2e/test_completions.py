"""/v1/completions: text and token-id prompts, batches of prompts, n, echo, streaming, usage."""

from __future__ import annotations

from tests.conftest import requires_smollm2
from tests.e2e import offline

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
PROMPTS = ["The sea is", "def fibonacci(n):"]


def test_greedy_batch_matches_offline(client, llm_fp32):
    expected = offline.generate(llm_fp32, PROMPTS, temperature=0.0, max_tokens=16)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, temperature=0, max_tokens=16, n=2)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [e.outputs[0].text for e in expected for _ in range(2)]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert resp.usage.completion_tokens == 2 * sum(len(e.outputs[0].token_ids) for e in expected)


def test_stream_token_prompt_with_usage(client, llm_fp32):
    ids = llm_fp32.get_tokenizer().encode(PROMPTS[0])
    expected = offline.generate(llm_fp32, [{"prompt_token_ids": ids}], temperature=0.0, max_tokens=16)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_echo_and_stop(client, llm_fp32):
    full = offline.generate(llm_fp32, [PROMPTS[0]], temperature=0.0, max_tokens=16)[0]
    stop = full.outputs[0].text.split()[2]
    expected = offline.generate(llm_fp32, [PROMPTS[0]], temperature=0.0, max_tokens=16, stop=[stop])[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=16, stop=[stop],
                                     echo=True)
    assert resp.choices[0].text == PROMPTS[0] + expected.outputs[0].text
    assert resp.choices[0].finish_reason == "stop"
