"""KV blocks between two real `ferrylm serve` processes (--kv-role): the prefill replica runs the
prompt, its cached blocks go over HTTP to the decode replica, whose chat answer for that prompt is
the offline answer while its prefix-cache counter shows the transferred tokens were not recomputed.
Wrong roles, bad bodies and oversize bodies get clear errors; the routes take only the replicas'
transfer credential (a client's API key gets 403, no key 401)."""

from __future__ import annotations

import sys

import httpx
import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess
from tests.proc_switches import voluntary_switches

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
TRANSFER_KEY = "kv-transfer-secret-0123456789"
API_KEY = "sk-client-key-0123456789"
KV = {"Authorization": f"Bearer {TRANSFER_KEY}"}
MESSAGES = [{"role": "user", "content": "Describe, in two sentences, a lighthouse at dusk on a rocky coast "
                                        "where the fishing boats come home and the gulls circle overhead."}]


@pytest.fixture(scope="module")
def replicas():
    prefill = ServerProcess("--dtype", "float32", "--kv-role", "prefill", "--kv-transfer-key", TRANSFER_KEY,
                            api_key=API_KEY)
    decode = ServerProcess("--dtype", "float32", "--kv-role", "decode", "--max-kv-transfer-bytes", "3000000",
                           "--kv-transfer-key", TRANSFER_KEY, api_key=API_KEY)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def _prefill_and_export(prefill: ServerProcess) -> tuple[list[int], httpx.Response]:
    """MESSAGES' prompt ids, prefilled on `prefill`, and its export of their cached blocks."""
    ids = httpx.post(prefill.url("/tokenize"), json={"model": MODEL, "messages": MESSAGES}, timeout=30,
                     headers=prefill.headers()).json()["tokens"]
    done = httpx.post(prefill.url("/v1/completions"), timeout=60, headers=prefill.headers(),
                      json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0})
    assert done.status_code == 200
    return ids, httpx.post(prefill.url("/v1/kv/export"), json={"prompt_token_ids": ids}, timeout=60, headers=KV)


def test_decode_replica_continues_from_the_prefill_replicas_blocks(replicas, llm_fp32):
    prefill, decode = replicas
    ids, body = _prefill_and_export(prefill)
    assert len(ids) >= 48
    assert body.status_code == 200 and body.headers["content-type"] == "application/octet-stream"
    hits0 = decode.wait_idle()["ferrylm:prefix_cache_hits_total"]
    imported = httpx.post(decode.url("/v1/kv/import"), content=body.content, timeout=60, headers=KV).json()
    # only blocks the decode replica lacks are written: the chat template's system preamble (the first
    # block) may already be cached there by its readiness probe
    assert 2 <= imported["imported_blocks"] <= len(ids) // 16
    reply = decode.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
    expected = llm_fp32.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert reply.choices[0].message.content == expected.outputs[0].text
    hits = decode.wait_idle()["ferrylm:prefix_cache_hits_total"] - hits0
    assert len(ids) % 16 and hits == len(ids) // 16 * 16  # every full block came from the cache: none recomputed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_after_a_transfer_decode_steps_do_not_sleep_between_parallel_regions(replicas):
    """The load, the export and the import leave no second OpenMP pool in either server (each would
    stop libgomp spinning: hundreds of sleeps and wake-ups per decode step, short_lived_thread.py)."""
    prefill, decode = replicas
    _, body = _prefill_and_export(prefill)
    body.raise_for_status()
    httpx.post(decode.url("/v1/kv/import"), content=body.content, timeout=60, headers=KV).raise_for_status()
    for server in (prefill, decode):
        server.wait_idle()
        before = voluntary_switches(server.proc.pid)
        done = httpx.post(server.url("/v1/completions"), timeout=120, headers=server.headers(),
                          json={"model": MODEL, "prompt": "Tides", "max_tokens": 64, "ignore_eos": True,
                                "temperature": 0}).json()
        per_token = (voluntary_switches(server.proc.pid) - before) / done["usage"]["completion_tokens"]
        assert per_token < 40, per_token  # one team: a few (the event loop's wake-ups); two: hundreds


def test_only_the_transfer_credential_opens_the_kv_routes(replicas):
    prefill, decode = replicas
    for server, path in ((prefill, "/v1/kv/export"), (decode, "/v1/kv/import")):
        none = httpx.post(server.url(path), json={"prompt_token_ids": [1]}, timeout=30)
        assert none.status_code == 401
        tenant = httpx.post(server.url(path), json={"prompt_token_ids": [1]}, timeout=30,
                            headers={"Authorization": f"Bearer {API_KEY}"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "permission_denied"
        for key in ("forged-" + TRANSFER_KEY, TRANSFER_KEY[:-1], TRANSFER_KEY + " "):  # what /v1 refuses too: 401
            refused = httpx.post(server.url(path), json={"prompt_token_ids": [1]}, timeout=30,
                                 headers={"Authorization": f"Bearer {key}x"})
            assert refused.status_code == 401
    # and the transfer key is no API key
    assert httpx.get(prefill.url("/v1/models"), headers=KV, timeout=30).status_code == 401


def test_wrong_role_bad_body_and_oversize_are_clear_errors(replicas):
    prefill, decode = replicas

    def post(server, path, **kw):
        return httpx.post(server.url(path), timeout=30, headers=KV, **kw)

    off = post(decode, "/v1/kv/export", json={"prompt_token_ids": [1, 2]})
    assert off.status_code == 404 and "--kv-role prefill" in off.json()["error"]["message"]
    assert post(prefill, "/v1/kv/import", content=b"x").status_code == 404
    too_big = post(decode, "/v1/kv/import", content=b"\0" * 3_000_001)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    for garbage in (b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", b"", b"\xff" * 8, b"\x02\0\0\0\0\0\0\0[]"):
        bad = post(decode, "/v1/kv/import", content=garbage)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "body", garbage
    bad_ids = post(prefill, "/v1/kv/export", json={"prompt_token_ids": [-1]})
    assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "prompt_token_ids"
    bad_salt = post(prefill, "/v1/kv/export", json={"prompt_token_ids": [1], "cache_salt": 5})
    assert bad_salt.status_code == 400 and bad_salt.json()["error"]["param"] == "cache_salt"
    empty = post(prefill, "/v1/kv/export", json={"prompt_token_ids": [5, 6, 7]})
    assert empty.status_code == 200  # no full block: an empty transfer, imported as nothing
    assert post(decode, "/v1/kv/import", content=empty.content).json() == {"imported_blocks": 0}


def test_a_forged_import_is_refused_and_changes_nothing(replicas):
    """Blocks of the right layout carrying NaN, or hashes that are not of their tokens: 400, and the
    decode replica's answer to that prompt stays what it computes itself."""
    import torch

    from ferrylm.kv_transfer import KVBlocks

    prefill, decode = replicas
    prompt = list(range(100, 164))
    assert httpx.post(prefill.url("/v1/completions"), timeout=60, headers=prefill.headers(),
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}).status_code == 200
    kv = KVBlocks.from_bytes(httpx.post(prefill.url("/v1/kv/export"), json={"prompt_token_ids": prompt},
                                        timeout=60, headers=KV).content)
    assert len(kv.hashes) == 4
    poisoned = kv.data.clone()
    poisoned[0, 0, 1] = float("nan")
    before = decode.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    forged = (kv._replace(data=poisoned), kv._replace(token_ids=[t + 1 for t in kv.token_ids]),
              kv._replace(data=kv.data[:, :, :, :8].contiguous()), kv._replace(data=torch.zeros_like(kv.data).half()))
    for bad in forged:
        r = httpx.post(decode.url("/v1/kv/import"), content=bad.to_bytes(), timeout=60, headers=KV)
        assert r.status_code in (400, 409), r.text
    mismatched = httpx.post(decode.url("/v1/kv/import"), timeout=60, headers=KV,
                            content=kv._replace(layout=kv.layout | {"block_size": 32}).to_bytes())
    assert mismatched.status_code == 409 and mismatched.json()["error"]["code"] == "kv_layout_mismatch"
    after = decode.client().completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert after == before
    assert httpx.get(decode.url("/health"), timeout=10).status_code == 200
