"""KV blocks between two real `ferrylm serve` processes (--kv-role): the prefill replica runs the
prompt, its cached blocks go over HTTP to the decode replica, whose chat answer for that prompt is
the offline answer while its prefix-cache counter shows the transferred tokens were not recomputed.
Wrong roles, bad bodies and oversize bodies get clear errors."""

from __future__ import annotations

import httpx
import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Describe, in two sentences, a lighthouse at dusk on a rocky coast "
                                        "where the fishing boats come home and the gulls circle overhead."}]


@pytest.fixture(scope="module")
def replicas():
    prefill = ServerProcess("--dtype", "float32", "--kv-role", "prefill")
    decode = ServerProcess("--dtype", "float32", "--kv-role", "decode", "--max-kv-transfer-bytes", "3000000")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_decode_replica_continues_from_the_prefill_replicas_blocks(replicas, llm_fp32):
    prefill, decode = replicas
    ids = httpx.post(prefill.url("/tokenize"), json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()["tokens"]
    assert len(ids) >= 48
    done = httpx.post(prefill.url("/v1/completions"), timeout=60,
                      json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert done.status_code == 200
    body = httpx.post(prefill.url("/v1/kv/export"), json={"prompt_token_ids": ids}, timeout=60)
    assert body.status_code == 200 and body.headers["content-type"] == "application/octet-stream"
    hits0 = decode.wait_idle()["ferrylm:prefix_cache_hits_total"]
    imported = httpx.post(decode.url("/v1/kv/import"), content=body.content, timeout=60).json()
    # only blocks the decode replica lacks are written: the chat template's system preamble (the first
    # block) may already be cached there by its readiness probe
    assert 2 <= imported["imported_blocks"] <= len(ids) // 16
    reply = decode.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    expected = llm_fp32.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert reply.choices[0].message.content == expected.outputs[0].text
    hits = decode.wait_idle()["ferrylm:prefix_cache_hits_total"] - hits0
    assert len(ids) % 16 and hits == len(ids) // 16 * 16  # every full block came from the cache: none recomputed


def test_wrong_role_bad_body_and_oversize_are_clear_errors(replicas):
    prefill, decode = replicas
    off = httpx.post(decode.url("/v1/kv/export"), json={"prompt_token_ids": [1, 2]}, timeout=30)
    assert off.status_code == 404 and "--kv-role prefill" in off.json()["error"]["message"]
    assert httpx.post(prefill.url("/v1/kv/import"), content=b"x", timeout=30).status_code == 404
    too_big = httpx.post(decode.url("/v1/kv/import"), content=b"\0" * 3_000_001, timeout=30)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(decode.url("/v1/kv/import"), content=b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
    bad_ids = httpx.post(prefill.url("/v1/kv/export"), json={"prompt_token_ids": [-1]}, timeout=30)
    assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "prompt_token_ids"
    empty = httpx.post(prefill.url("/v1/kv/export"), json={"prompt_token_ids": [5, 6, 7]}, timeout=30)
    assert empty.status_code == 200  # no full block: an empty transfer, imported as nothing
    assert httpx.post(decode.url("/v1/kv/import"), content=empty.content, timeout=30).json() == {"imported_blocks": 0}
