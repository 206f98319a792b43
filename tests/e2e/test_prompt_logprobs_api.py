"""Prompt logprobs through /v1/completions on a real server process: OpenAI's legacy scoring request
(echo + logprobs + max_tokens 0, what lm-evaluation-harness sends for loglikelihood) and vLLM's
prompt_logprobs, with values equal to the offline engine's on the same float32 model."""

from __future__ import annotations

import httpx
import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
TEXT = "The quick brown fox jumps over the lazy dog."


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url("/v1/completions"), json={"model": MODEL, **body}, timeout=120)


@pytest.fixture(scope="module")
def offline(llm_fp32):
    """The offline engine's prompt logprobs of TEXT (top 2) and its token ids."""
    ids = llm_fp32.get_tokenizer().encode(TEXT)
    out = llm_fp32.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                            use_tqdm=False)[0]
    return ids, out.prompt_logprobs


def test_echo_logprobs_with_max_tokens_zero_scores_the_prompt(api_server, client, offline):
    ids, want = offline
    resp = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = resp.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - want[p][ids[p]].logprob) < 1e-4
        assert len(lp.top_logprobs[p]) == 1 and max(lp.top_logprobs[p].values()) >= lp.token_logprobs[p] - 1e-6


def test_echo_logprobs_then_generated_tokens(api_server):
    r = _post(api_server, {"prompt": TEXT, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n_prompt, n_out = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    assert n_out == 3 and len(lp["tokens"]) == n_prompt + 3 and choice["text"].startswith(TEXT)
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][n_prompt] == len(TEXT)  # generated tokens start after the echoed text


def test_scoring_with_n_gives_every_choice_the_prompt_scores(api_server, offline):
    """n > 1 scores the prompt once (the other samples reuse its blocks), yet every choice carries
    the prompt's logprobs, and the usage bills the prompt once."""
    ids, want = offline
    r = _post(api_server, {"prompt": TEXT, "max_tokens": 2, "echo": True, "logprobs": 1, "n": 3,
                           "prompt_logprobs": 2, "temperature": 0.7, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 3 and body["usage"]["prompt_tokens"] == len(ids)
    for choice in body["choices"]:
        lp = choice["logprobs"]["token_logprobs"]
        assert all(abs(lp[p] - want[p][ids[p]].logprob) < 1e-4 for p in range(1, len(ids)))
        assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)


def test_vllm_prompt_logprobs_field(api_server, offline):
    ids, want = offline
    r = _post(api_server, {"prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert abs(entry["logprob"] - want[p][ids[p]].logprob) < 1e-4 and entry["rank"] == want[p][ids[p]].rank
        assert 2 <= len(plp[p]) <= 3 and all(isinstance(e["decoded_token"], str) for e in plp[p].values())
    plain = _post(api_server, {"prompt": TEXT, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": TEXT, "echo": True, "logprobs": 1, "stream": True}, "stream"),
    ({"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": TEXT, "max_tokens": -1}, "max_tokens"),
])
def test_bad_prompt_logprob_requests(api_server, body, param):
    r = _post(api_server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
