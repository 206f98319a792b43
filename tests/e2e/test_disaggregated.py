"""Disaggregated prefill/decode through `ferrylm gateway --policy disaggregated`: a prefill replica
(--kv-role prefill) runs each prompt, its KV blocks move to the decode replica (--kv-role decode),
which streams the answer. The client sees one normal OpenAI stream equal to a single replica's; the
decode replica's prefix-cache counter shows the prompt was not recomputed; with the prefill replica
killed, requests still complete (the decode replica recomputes) and the gateway counts the failure."""

from __future__ import annotations

import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
KEY = ("--kv-transfer-key", "kv-transfer-secret-0123456789")


def _messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write two sentences about {topic}, as a sailor would describe it "
                                        "to a child on a long evening by the harbour wall."}]


@pytest.fixture(scope="module")
def fleet():
    prefill = ServerProcess("--dtype", "float32", "--kv-role", "prefill", *KEY)
    decode = ServerProcess("--dtype", "float32", "--kv-role", "decode", *KEY)
    prefill.wait_ready()
    decode.wait_ready()
    gateway = ServerProcess("--upstream", decode.base_url, "--prefill-upstream", prefill.base_url, "--policy",
                            "disaggregated", "--no-gateway", "--poll-interval", "0.25", *KEY, command="gateway")
    gateway.wait_ready()
    yield prefill, decode, gateway
    for proc in (gateway, decode, prefill):
        proc.stop()


def _ids(llm, messages) -> list[int]:
    return llm.get_tokenizer().apply_chat_template(messages)


def test_one_stream_equal_to_a_single_replica_with_the_prompt_from_the_cache(fleet, llm_fp32):
    prefill, decode, gateway = fleet
    client = gateway.client()
    for topic, stream in (("the tide", False), ("a storm at sea", True)):
        messages = _messages(topic)
        expected = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        hits0 = decode.wait_idle()["ferrylm:prefix_cache_hits_total"]
        prefilled0 = prefill.wait_idle()["ferrylm:prompt_tokens_total"]
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                               stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream \
            else reply.choices[0].message.content
        assert text == expected.outputs[0].text
        ids = _ids(llm_fp32, messages)
        assert decode.wait_idle()["ferrylm:prefix_cache_hits_total"] - hits0 == (len(ids) - 1) // 16 * 16
        assert prefill.wait_idle()["ferrylm:prompt_tokens_total"] - prefilled0 == len(ids)  # it ran there
    assert gateway.metrics()[f"ferrylm:router_kv_transfers_total{{model_group={MODEL},outcome=ok}}"] == 2


def test_the_gateway_never_serves_the_kv_routes(fleet):
    import httpx

    gateway = fleet[2]
    for path in ("/v1/kv/export", "/v1/kv/import"):
        r = httpx.post(gateway.url(path), json={"prompt_token_ids": [1]}, timeout=10,
                       headers={"Authorization": f"Bearer {KEY[1]}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"


def test_a_dead_prefill_replica_falls_back_to_recompute(fleet, llm_fp32):
    prefill, decode, gateway = fleet
    prefill.proc.kill()
    prefill.proc.wait(10)
    messages = _messages("a quiet lighthouse")
    expected = llm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    reply = gateway.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == expected.outputs[0].text
    assert gateway.metrics()[f"ferrylm:router_kv_transfers_total{{model_group={MODEL},outcome=failed}}"] >= 1
