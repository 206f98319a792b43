"""Schemathesis against the server's own OpenAPI schema (M1.5), on a real engine: the tiny
random-weight Llama with a byte-level tokenizer, behind the gateway with --require-auth.

Without a valid credential no /v1 call is ever served: always 401 (auth runs before the body is
read, so an unauthenticated caller learns nothing about validation), never a 2xx or a 5xx. With a valid key
no generated request ever gets a 5xx, and every status is one the schema declares.
max_model_len is 64, so even n=128 with the longest allowed completion stays cheap on CPU.
"""

from __future__ import annotations

import dataclasses
import string
import threading
import time

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ferrylm.config import CacheConfig, EngineConfig, SchedulerConfig
from ferrylm.engine.engine import Engine
from ferrylm.gateway import GatewayConfig
from ferrylm.gateway.store import Store
from ferrylm.http.uvicorn_server import bind_socket
from ferrylm.server.app import build_app
from ferrylm.server.config import ServerConfig
from tests.conftest import examples
from tests.model.tiny_models import COMMON, make_tiny_model

MODEL = "tiny"
MAX_MODEL_LEN = 64
# Inherits derandomize=True from the ci profile (tests/conftest.py): schemathesis then applies no
# random seed of its own (it seeds only non-derandomized tests), so every run sends the same
# requests. `make fuzz` (profile "fuzz") randomizes and scales the examples up.
FUZZ = settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# What a request without a valid credential gets: 401, whatever its body.
UNAUTHENTICATED = {401}

# The schema the app publishes; the served one is checked to be the same below. (Loaded here
# rather than from the server fixture: schemathesis' lazy from_fixture breaks on pytest 9.2.)
SERVER_CONFIG = ServerConfig(served_model_names=(MODEL,))
schema = schemathesis.openapi.from_dict(build_app(SERVER_CONFIG, Engine.from_config).openapi()).include(
    path_regex="^/v1/")  # no lifespan runs here, so no engine is built
printable = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60)
bad_authorization = st.one_of(st.none(), printable, printable.map("Bearer ".__add__),
                              st.text("0123456789abcdef", max_size=40).map("Bearer fl-".__add__))


def save_tiny_tokenizer(directory) -> None:
    """A byte-level BPE with exactly the tiny model's vocabulary (every sampled id decodes), ids
    0-2 the special tokens (bos 1, eos 2, as in make_tiny_model), and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=COMMON["vocab_size"], show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator([" ".join(a + b for a in string.ascii_lowercase for b in string.ascii_lowercase)],
                            trainer)
    assert raw.get_vocab_size() == COMMON["vocab_size"]
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf.chat_template = CHATML
    hf.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The real app under uvicorn on a free loopback port, once /ready; yields (base URL, API key)."""
    root = tmp_path_factory.mktemp("fuzz-openapi")
    directory = make_tiny_model("llama", root / "tiny")
    save_tiny_tokenizer(directory)
    state_db = f"sqlite:///{root / 'state.db'}"
    store = Store(state_db)
    store.create_tenant("acme")
    key = store.create_key("acme")[1]
    store.close()
    engine_config = EngineConfig(model=str(directory), dtype="float32", enforce_eager=True,
                                 cache=CacheConfig(num_blocks=1024),
                                 scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN))
    config = dataclasses.replace(SERVER_CONFIG, log_level="warning",
                                 gateway=GatewayConfig(require_auth=True, state_db=state_db))
    app = build_app(config, lambda: Engine.from_config(engine_config))
    sock = bind_socket("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        deadline = time.monotonic() + 120
        while True:
            state = app.state.ferry
            assert state.load_error is None, f"engine failed to load: {state.load_error}"
            try:
                if httpx.get(f"{base_url}/ready", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not ready after 120 s"
            time.sleep(0.1)
        yield base_url, key
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()


# A generated `model` is almost always unknown (404); often name the served one (null means the
# default model) so that requests get past validation to auth and, with a key, to the engine.
model_names = st.sampled_from(["as generated", MODEL, None])


def name_model(case, model: str | None) -> None:
    if isinstance(case.body, dict) and model != "as generated":
        case.body["model"] = model


@schema.parametrize()
@schema.given(authorization=bad_authorization, model=model_names)
@FUZZ
def test_never_served_without_a_valid_credential(case, authorization, model, server):
    name_model(case, model)
    headers = {"Authorization": authorization} if authorization is not None else None
    response = case.call(base_url=server[0], headers=headers)
    event(f"status {response.status_code}")
    assert response.status_code in UNAUTHENTICATED, (response.status_code, response.text, response.request.url)
    if response.status_code == 401:
        error = response.json()["error"]
        anthropic = case.path.startswith("/v1/messages")  # Anthropic's shape there: {"type": "error", ...}
        assert (error["type"] == "authentication_error") if anthropic else error["code"]
        assert response.headers["www-authenticate"] == ["Bearer"]


@schema.parametrize()
@schema.given(model=model_names)
@FUZZ
def test_never_a_server_error_with_a_valid_key(case, model, server):
    name_model(case, model)
    response = case.call_and_validate(
        base_url=server[0], headers={"Authorization": f"Bearer {server[1]}"},
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance])
    event(f"status {response.status_code}")


def test_the_served_schema_is_the_one_fuzzed(server):
    assert httpx.get(f"{server[0]}/openapi.json", timeout=10).json() == schema.raw_schema
