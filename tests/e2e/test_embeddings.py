"""POST /v1/embeddings under `ferrylm serve --runner pooling` with the official openai client: each
vector equals transformers' final hidden state of the same tokens pooled the same way (last token,
L2-normalised; mean with --pooler-config) within 1e-4 in float32, batched and alone; base64 decodes to
the same floats; bad input is a clear 400; the generation routes answer 400 on a pooling server."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
TEXTS = ["The ferry leaves at dawn.", "Embeddings map text to vectors.", "A harbour, some gulls and a long pier."]


@pytest.fixture(scope="module")
def pooling():
    servers = {"last": ServerProcess("--dtype", "float32", "--runner", "pooling"),
               "mean": ServerProcess("--dtype", "float32", "--runner", "pooling", "--pooler-config",
                                     '{"pooling_type": "MEAN", "normalize": false}')}
    for s in servers.values():
        s.wait_ready()
    yield servers
    for s in servers.values():
        assert s.stop() == 0, s.log_tail()


def _ids(server: ServerProcess, text: str) -> list[int]:
    return httpx.post(server.url("/tokenize"), json={"model": MODEL, "prompt": text}, timeout=30).json()["tokens"]


def _reference(hf_reference, ids: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_reference.model(torch.tensor([ids])).last_hidden_state[0].float()
    if kind == "last":
        return torch.nn.functional.normalize(hidden[-1], dim=0)
    return hidden.mean(dim=0)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_vectors_equal_transformers_pooled_the_same_way(pooling, hf_reference, kind) -> None:
    server = pooling[kind]
    client = server.client()
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.object == "list"
    prompt_tokens = 0
    for text, item in zip(TEXTS, batch.data):
        ids = _ids(server, text)
        prompt_tokens += len(ids)
        want = _reference(hf_reference, ids, kind)
        got = torch.tensor(item.embedding)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        alone = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
        assert torch.allclose(torch.tensor(alone), got, atol=1e-5)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == prompt_tokens
    token_input = client.embeddings.create(model=MODEL, input=[_ids(server, TEXTS[0])], encoding_format="float")
    assert torch.allclose(torch.tensor(token_input.data[0].embedding), torch.tensor(batch.data[0].embedding),
                          atol=1e-5)


def test_base64_is_the_same_floats_and_the_sdk_default_decodes(pooling) -> None:
    server = pooling["last"]
    as_float = server.client().embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    raw = httpx.post(server.url("/v1/embeddings"), timeout=60,
                     json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(as_float.data[0].embedding,
                                                                                  abs=1e-6)
    default = server.client().embeddings.create(model=MODEL, input=TEXTS[0])  # the SDK asks for base64
    assert default.data[0].embedding == pytest.approx(as_float.data[0].embedding, abs=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["ok", ""]}, "input"),
    ({"input": "word " * 9000}, "input"), ({"input": [[1, 2, 10 ** 9]]}, None),
    ({"input": "hello", "dimensions": 3}, "dimensions"), ({"input": "hello", "encoding_format": "int8"}, None),
    ({"input": "hello", "truncate_prompt_tokens": 4}, None),
])
def test_bad_input_is_a_clear_400(pooling, body, param) -> None:
    r = httpx.post(pooling["last"].url("/v1/embeddings"), json={"model": MODEL} | body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and (param is None or error["param"] == param), error


def test_a_pooling_server_does_not_generate_and_a_generating_one_does_not_embed(pooling, api_server) -> None:
    with pytest.raises(openai.BadRequestError, match="pooling"):
        pooling["last"].client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        api_server.client().embeddings.create(model=MODEL, input="hi")


def test_through_the_gateway_counted_and_billed(pooling, tmp_path) -> None:
    """`ferrylm gateway --require-auth` in front of the pooling replica: a tenant's key gets the same
    vectors as the replica gives directly, and the audit row bills the prompt tokens the usage says."""
    import sqlite3

    from tests.e2e.server_process import make_keys

    db = tmp_path / "gw.db"
    keys = make_keys(f"sqlite:///{db}", {"embedder": {}})
    gateway = ServerProcess("--upstream", pooling["last"].base_url, "--require-auth", "--state-db",
                            f"sqlite:///{db}", "--poll-interval", "0.25", command="gateway")
    try:
        gateway.wait_ready(60)
        with pytest.raises(openai.AuthenticationError):
            gateway.client(api_key="wrong").embeddings.create(model=MODEL, input=TEXTS[0])
        via = gateway.client(api_key=keys["embedder"]).embeddings.create(model=MODEL, input=TEXTS,
                                                                         encoding_format="float")
        direct = pooling["last"].client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        for a, b in zip(via.data, direct.data):
            assert torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-5)
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT tenant, prompt_tokens, completion_tokens FROM audit_log WHERE status = 200 "
                               "ORDER BY id DESC LIMIT 1").fetchone()
        assert row == ("embedder", via.usage.prompt_tokens, 0)
    finally:
        gateway.stop()


def test_a_sentence_transformers_checkpoint_pools_as_its_modules_say(tmp_path) -> None:
    """A tiny random model with a sentence-transformers layout (mean pooling, then Normalize) served with
    no --pooler-config: each vector is transformers' mean hidden state, L2-normalised."""
    import json

    import transformers

    from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

    model = add_word_tokenizer(make_tiny_model("llama", tmp_path / "st"))
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False,
         "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": False, "include_prompt": True}))
    inputs = [[1, 20, 21, 22, 23], [1, 7, 8, 9, 10, 11, 12, 13, 14]]
    server = ServerProcess("--model", str(model), "--served-model-name", "st", "--dtype", "float32",
                           "--runner", "pooling")
    try:
        server.wait_ready()
        got = server.client().embeddings.create(model="st", input=inputs, encoding_format="float")
    finally:
        assert server.stop() == 0, server.log_tail()
    hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32)
    for ids, item in zip(inputs, got.data):
        with torch.no_grad():
            want = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0), dim=0)
        assert torch.allclose(torch.tensor(item.embedding), want, atol=1e-4)
