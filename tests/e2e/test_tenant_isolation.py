"""Prefix-cache isolation between tenants (vLLM's cache_salt) and `cached_tokens` reporting, on real
processes through both front doors (`ferrylm serve --require-auth` and `ferrylm gateway
--require-auth` in front of a replica): a tenant repeating its prompt is served from the cache and
told so (chat, completions, Responses, streamed usage and the audit row agree); another tenant
sending the very same prompt, or forging the first tenant's salt, gets no hit at all."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess, make_keys

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
MESSAGES = [
    {
        "role": "user",
        "content": "Tell me, in three careful sentences, how a ferry crosses a wide river "
        "against the current when the wind is blowing from the east at dawn.",
    }
]


def _front_doors(tmp_path_factory, replica: ServerProcess):
    db = tmp_path_factory.mktemp("iso") / "state.db"
    url = f"sqlite:///{db}"
    keys = make_keys(url, {"alpha": {}, "beta": {}, "gamma": {"models": ("another-model",)}})
    serve = ServerProcess("--dtype", "float32", "--require-auth", "--state-db", url)
    serve.wait_ready()
    gw_db = tmp_path_factory.mktemp("iso-gw") / "state.db"
    gw_keys = make_keys(f"sqlite:///{gw_db}", {"alpha": {}, "beta": {}, "gamma": {"models": ("another-model",)}})
    gateway = ServerProcess(
        "--upstream",
        replica.base_url,
        "--require-auth",
        "--state-db",
        f"sqlite:///{gw_db}",
        "--poll-interval",
        "0.25",
        command="gateway",
    )
    gateway.wait_ready(60)
    return {"serve": (serve, keys, db), "gateway": (gateway, gw_keys, gw_db)}, (serve, gateway)


@pytest.fixture(scope="module")
def doors(tmp_path_factory, api_server: ServerProcess):
    """`ferrylm serve --require-auth`, and `ferrylm gateway --require-auth` in front of the shared
    session server (an open replica: it takes the salt the gateway sends)."""
    by_name, procs = _front_doors(tmp_path_factory, api_server)
    yield by_name
    for p in reversed(procs):
        assert p.stop() == 0, p.log_tail()


def _chat_cached(server: ServerProcess, key: str, **extra) -> int:
    reply = server.client(api_key=key).chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4, extra_body=extra or None
    )
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("door", ["serve", "gateway"])
def test_one_tenants_cached_prompt_is_never_anothers_hit(doors, door):
    server, keys, db = doors[door]
    alpha, beta = keys["alpha"], keys["beta"]
    assert _chat_cached(server, alpha) == 0  # nothing of this prompt anywhere yet (not even the template)
    repeat = _chat_cached(server, alpha)
    assert repeat >= 32 and repeat % 16 == 0  # the repeat is served from alpha's cache
    assert _chat_cached(server, beta) == 0  # the very same prompt: no hit for beta
    forged = json.dumps(["tenant", "alpha", None], separators=(",", ":"))
    assert _chat_cached(server, beta, cache_salt=forged) == 0  # beta cannot name alpha's salt
    assert _chat_cached(server, alpha, cache_salt="alpha-private") == 0  # a salt narrows alpha's own sharing
    assert _chat_cached(server, alpha, cache_salt="alpha-private") == repeat
    assert _chat_cached(server, beta) == repeat  # beta's own repeat hits beta's own blocks

    # the same cached count on every endpoint, streamed usage, and the audit row
    client = server.client(api_key=alpha)
    ids = httpx.post(
        server.url("/tokenize"),
        json={"model": MODEL, "messages": MESSAGES},
        timeout=30,
        headers={"Authorization": f"Bearer {alpha}"},
    ).json()["tokens"]
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert completion.usage.prompt_tokens_details.cached_tokens == repeat
    response = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=4, temperature=0)
    assert response.usage.input_tokens_details.cached_tokens == repeat
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == repeat
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT tenant, prompt_tokens, cached_tokens FROM audit_log WHERE status = 200 ORDER BY id"
        ).fetchall()
    alpha_rows = [r for r in rows if r[0] == "alpha"]
    assert alpha_rows[0][2] == 0 and alpha_rows[1][2] == repeat and alpha_rows[-1][2] == repeat, rows
    assert [r[2] for r in rows if r[0] == "beta"] == [0, 0, repeat]


@pytest.mark.parametrize("door", ["serve", "gateway"])
def test_the_model_allowlist_holds_on_tokenize_and_detokenize(doors, door):
    server, keys, _ = doors[door]
    for path, body in (
        ("/tokenize", {"model": MODEL, "prompt": "hi"}),
        ("/detokenize", {"model": MODEL, "tokens": [1]}),
    ):
        refused = httpx.post(
            server.url(path), json=body, timeout=30, headers={"Authorization": f"Bearer {keys['gamma']}"}
        )
        assert refused.status_code == 403, refused.text
        allowed = httpx.post(
            server.url(path), json=body, timeout=30, headers={"Authorization": f"Bearer {keys['alpha']}"}
        )
        assert allowed.status_code == 200, allowed.text
