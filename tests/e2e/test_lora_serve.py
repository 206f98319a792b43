"""LoRA adapters through a real `ferrylm serve`: chosen by the request's model name, listed in
/v1/models with their parent, loaded and unloaded at run time behind --lora-admin-key (a client's
key gets 403) while another adapter's stream runs unchanged; every answer is peft's merged model's."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.server_process import ServerProcess
from tests.model.lora_adapters import make_adapter, merged_greedy
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model

pytest.importorskip("peft")
ADMIN_KEY = "lora-admin-secret-0123456789"
API_KEY = "sk-client-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPTS = {"base": [1, 200, 201, 202, 203, 204, 205], "attn8": [1, 5, 9, 33, 70, 100, 7, 8, 9, 10],
           "all16": [1, 44, 45, 46]}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serve")
    base = add_word_tokenizer(make_tiny_model("llama", root / "base"))
    adapters = {"attn8": make_adapter(base, root / "attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
                "all16": make_adapter(base, root / "all16", 16, seed=2)}
    refs = {name: merged_greedy(base, adapters.get(name), PROMPTS[name], MAX_TOKENS) for name in PROMPTS}
    server = ServerProcess("--model", str(base), "--served-model-name", "base", "--dtype", "float32",
                           "--enable-lora", "--max-loras", "2", "--lora-modules", f"attn8={adapters['attn8']}",
                           "--lora-admin-key", ADMIN_KEY, api_key=API_KEY)
    try:
        server.wait_ready()
        yield server, adapters, refs
    finally:
        assert server.stop() == 0


async def _complete(server: ServerProcess, model: str, prompt: str | None = None, max_tokens: int = MAX_TOKENS):
    client = server.async_client()
    out = await client.completions.create(model=model, prompt=PROMPTS[prompt or model], max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    return out


def _ids(out) -> list[int]:
    """The word tokenizer's token i is the word "t{i}"."""
    return [int(word[1:]) for word in out.choices[0].text.split()]


def test_adapters_listed_with_their_parent(setup):
    server, adapters, _ = setup
    cards = {m.id: m for m in server.client().models.list().data}
    assert set(cards) == {"base", "attn8"}
    assert cards["attn8"].model_extra["parent"] == "base" and cards["attn8"].model_extra["root"] == str(
        adapters["attn8"])
    assert server.client().models.retrieve("attn8").id == "attn8"


def test_admin_routes_take_only_the_admin_key(setup):
    server, adapters, _ = setup
    body = {"lora_name": "x", "lora_path": str(adapters["all16"])}
    assert httpx.post(server.url("/v1/load_lora_adapter"), json=body).status_code == 401
    forbidden = httpx.post(server.url("/v1/load_lora_adapter"), json=body, headers=server.headers())
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "permission_denied"
    bad = httpx.post(server.url("/v1/load_lora_adapter"), headers=ADMIN,
                     json={"lora_name": "bad", "lora_path": "/nonexistent"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    assert httpx.post(server.url("/v1/unload_lora_adapter"), headers=ADMIN,
                      json={"lora_name": "never"}).status_code == 404


def test_mixed_requests_and_runtime_load_unload(setup):
    """A long attn8 stream runs while all16 is loaded, used beside the base model and attn8, and
    unloaded; attn8's tokens stay peft's, an unknown or unloaded adapter is 404 model_not_found."""
    server, adapters, refs = setup

    async def scenario():
        long_stream = asyncio.create_task(_complete(server, "attn8"))
        load = await asyncio.to_thread(httpx.post, server.url("/v1/load_lora_adapter"), headers=ADMIN,
                                       json={"lora_name": "all16", "lora_path": str(adapters["all16"])}, timeout=60)
        assert load.status_code == 200, load.text
        outs = await asyncio.gather(*(_complete(server, m) for m in ("base", "all16", "attn8")))
        stream = await server.async_client().completions.create(
            model="all16", prompt=PROMPTS["all16"], max_tokens=480, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        refused = None
        async for _ in stream:  # in flight: its adapter cannot be unloaded under it
            if refused is None:
                refused = await asyncio.to_thread(httpx.post, server.url("/v1/unload_lora_adapter"),
                                                  headers=ADMIN, json={"lora_name": "all16"}, timeout=60)
        return await long_stream, outs, refused

    first, outs, refused = asyncio.run(scenario())
    assert _ids(first) == refs["attn8"]
    assert [_ids(o) for o in outs] == [refs["base"], refs["all16"], refs["attn8"]]
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_busy"
    done = httpx.post(server.url("/v1/unload_lora_adapter"), headers=ADMIN, json={"lora_name": "all16"}, timeout=60)
    assert done.status_code == 200
    missing = httpx.post(server.url("/v1/completions"), headers=server.headers(),
                         json={"model": "all16", "prompt": PROMPTS["all16"], "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_load_and_metrics_name_the_adapters(setup):
    server, _, _ = setup
    load = httpx.get(server.url("/load"), timeout=30).json()
    assert load["lora_adapters"] == ["attn8"] and load["max_lora"] == 2
    metrics = httpx.get(server.url("/metrics"), timeout=30).text
    assert 'ferrylm:lora_requests_info{max_lora="2"' in metrics


@pytest.fixture(scope="module")
def gateway(setup, tmp_path_factory):
    """`ferrylm gateway` over the adapter replica and a second replica of the same base without
    adapters; two tenants whose model lists name the adapter or the base model only."""
    from tests.e2e.server_process import make_keys

    server, _, _ = setup
    root = tmp_path_factory.mktemp("lora-gateway")
    plain = ServerProcess("--model", str(server_base(setup)), "--served-model-name", "base", "--dtype", "float32",
                          api_key=API_KEY)
    db = f"sqlite:///{root / 'gw.db'}"
    keys = make_keys(db, {"lora-only": {"models": ("attn8",)}, "base-only": {"models": ("base",)}})
    gw = None
    try:
        plain.wait_ready()
        gw = ServerProcess("--upstream", f"base={server.base_url}", "--upstream", f"base={plain.base_url}",
                           "--upstream-api-key", API_KEY, "--require-auth", "--state-db", db, "--policy",
                           "round-robin", "--poll-interval", "0.25", "--expose-upstream-header", command="gateway")
        gw.wait_ready(60)
        yield gw, keys, server, plain
    finally:
        if gw is not None:
            gw.stop()
        plain.stop()


def server_base(setup) -> str:
    server, adapters, _ = setup
    return str(adapters["attn8"].parent / "base")


def test_gateway_routes_an_adapter_to_the_replica_that_holds_it(gateway, setup):
    gw, keys, holder, _ = gateway
    refs = setup[2]
    auth = {"Authorization": f"Bearer {keys['lora-only']}"}
    cards = {m["id"]: m for m in httpx.get(gw.url("/v1/models"), headers=auth, timeout=30).json()["data"]}
    assert cards["attn8"]["parent"] == "base"
    for _ in range(4):  # round-robin would send every other one to the replica without it
        r = httpx.post(gw.url("/v1/completions"), headers=auth, timeout=60, json={
            "model": "attn8", "prompt": PROMPTS["attn8"], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "skip_special_tokens": False})
        assert r.status_code == 200, r.text
        assert r.headers["x-ferrylm-upstream"] == holder.base_url
        assert [int(w[1:]) for w in r.json()["choices"][0]["text"].split()] == refs["attn8"]


def test_tenant_model_lists_name_adapters(gateway):
    gw, keys, _, _ = gateway

    def status(tenant: str, model: str) -> int:
        return httpx.post(gw.url("/v1/completions"), headers={"Authorization": f"Bearer {keys[tenant]}"},
                          json={"model": model, "prompt": [1, 2, 3], "max_tokens": 2}, timeout=60).status_code

    assert (status("lora-only", "attn8"), status("lora-only", "base")) == (200, 403)
    assert (status("base-only", "base"), status("base-only", "attn8")) == (200, 403)
    assert status("base-only", "no-such-adapter") == 404
