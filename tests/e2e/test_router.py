"""`ferrylm gateway` in front of two real `ferrylm serve` replicas on loopback: proxying
(streamed and not, byte-exact greedy text, request ids), prefix affinity vs round-robin on the
fleet's real prefix-cache counters, client disconnects freeing replica KV, fallbacks, and the
gateway's own auth in front of the fleet. A replica killed or stuck under load is in
tests/faults/test_fleet.py."""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.server_process import ServerProcess

REPLICA_ARGS = ("--no-gateway", "--dtype", "float32", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024")
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def replicas():
    procs = [ServerProcess(*REPLICA_ARGS) for _ in range(2)]
    for p in procs:
        p.wait_ready()
    yield procs
    for p in procs:
        p.stop()


def start_gateway(*args: str) -> ServerProcess:
    gw = ServerProcess(*args, "--poll-interval", "0.25", "--expose-upstream-header", command="gateway")
    gw.wait_ready(60)
    return gw


def stop(gw: ServerProcess) -> None:
    code = gw.stop()
    assert code == 0, gw.log_tail()


def router_metrics(gw: ServerProcess, name: str) -> dict[str, float]:
    return {k: v for k, v in gw.metrics().items() if k.startswith(f"ferrylm:router_{name}")}


def chat(messages: list[dict], **kw) -> dict:
    return {"model": MODEL, "messages": messages, "temperature": 0, **kw}


def test_proxy_passes_responses_through(replicas):
    gw = start_gateway("--upstream", replicas[0].base_url, "--upstream", replicas[1].base_url, "--no-gateway")
    try:
        client = gw.client()
        messages = [{"role": "user", "content": "Name three colours."}]
        direct = replicas[0].client().chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                                              temperature=0)
        via = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=20,
                                                               temperature=0, extra_headers={"X-Request-Id": "rid-42"})
        assert via.headers["x-ferrylm-upstream"] in {r.base_url for r in replicas}
        body = via.parse()
        assert body.choices[0].message.content == direct.choices[0].message.content
        assert body.id == "rid-42" and via.headers["x-request-id"] == "rid-42", "request id reaches the replica"
        assert body.usage.completion_tokens == direct.usage.completion_tokens
        # Streams: same text, no usage chunk unless asked (the gateway asks upstream regardless).
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            direct.choices[0].message.content
        assert all(c.usage is None for c in chunks)
        chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens > 0
        # Bad input is answered with OpenAI-style errors, by the gateway or passed through.
        r = httpx.post(gw.url("/v1/chat/completions"), json=chat(messages, max_tokens=0))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = httpx.post(gw.url("/v1/chat/completions"), json=chat(messages) | {"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(gw.url("/v1/completions"), json={"model": MODEL, "prompt": "x" * 40000, "max_tokens": 4})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
        assert [m["id"] for m in httpx.get(gw.url("/v1/models")).json()["data"]] == [MODEL]
        outstanding = router_metrics(gw, "upstream_outstanding_tokens")
        assert len(outstanding) == 2 and sum(outstanding.values()) == 0, outstanding
    finally:
        stop(gw)


def _prefix_counters(replicas) -> tuple[float, float]:
    ms = [r.metrics() for r in replicas]
    return (sum(m["ferrylm:prefix_cache_hits_total"] for m in ms),
            sum(m["ferrylm:prefix_cache_queries_total"] for m in ms))


def _system_prompts(tag: str) -> list[str]:
    topics = ["astronomy", "cooking", "maritime law", "chess openings"]
    return [f"[{tag}] You are an expert on {t}. " + " ".join(f"Rule {i}: answer about {t} with care, cite "
                                                                f"sources, stay concise." for i in range(20))
            for t in topics]


def _hit_rate(gw: ServerProcess, replicas, tag: str) -> float:
    systems = _system_prompts(tag)
    order = [i % 4 for i in range(16)]
    random.Random(7).shuffle(order)
    hits0, queries0 = _prefix_counters(replicas)
    with httpx.Client(timeout=120) as http:
        for n, s in enumerate(order):
            messages = [{"role": "system", "content": systems[s]}, {"role": "user", "content": f"Question {n}?"}]
            assert http.post(gw.url("/v1/chat/completions"), json=chat(messages, max_tokens=1)).status_code == 200
    hits1, queries1 = _prefix_counters(replicas)
    return (hits1 - hits0) / (queries1 - queries0)


def test_prefix_affinity_raises_the_fleet_hit_rate_over_round_robin(replicas):
    urls = [a for r in replicas for a in ("--upstream", r.base_url)]
    rates = {}
    for policy in ("round-robin", "prefix-affinity"):
        gw = start_gateway(*urls, "--policy", policy, "--no-gateway")
        try:
            rates[policy] = _hit_rate(gw, replicas, policy)
            decisions = router_metrics(gw, "routing_decisions")
        finally:
            stop(gw)
    print("fleet prefix-cache hit rate:", rates)
    assert rates["prefix-affinity"] > rates["round-robin"] + 0.15, rates
    assert any("prefix_" in k for k in decisions), decisions


def test_client_disconnect_at_the_gateway_frees_replica_kv(replicas):
    gw = start_gateway("--upstream", replicas[0].base_url, "--no-gateway")
    try:
        baseline = replicas[0].wait_idle()
        body = chat([{"role": "user", "content": "Write a very long story about a ferry."}], max_tokens=2000,
                    stream=True)
        with httpx.Client(timeout=60) as http, http.stream("POST", gw.url("/v1/chat/completions"), json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(12)]
            assert any('"content"' in line for line in got)
            during = replicas[0].metrics()
            assert during["ferrylm:num_requests_running"] == 1
            assert during["ferrylm:kv_cache_usage_perc"] > baseline["ferrylm:kv_cache_usage_perc"]
        after = replicas[0].wait_idle(timeout=15)
        assert after["ferrylm:kv_cache_usage_perc"] == baseline["ferrylm:kv_cache_usage_perc"]
        assert after["ferrylm:generation_tokens_total"] - baseline["ferrylm:generation_tokens_total"] < 1000
        deadline = time.monotonic() + 10
        while sum(router_metrics(gw, "upstream_in_flight_requests").values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(router_metrics(gw, "upstream_outstanding_tokens").values()) == 0
    finally:
        stop(gw)


def test_retries_fallback_groups_and_aliases(replicas, tmp_path):
    from tests.e2e.server_process import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "router.yaml"
    config.write_text(f"""
breaker_failures: 2
models:
  {MODEL}:
    upstreams: [{dead}, {replicas[1].base_url}]
    policy: round-robin
    aliases: [fast-model]
  primary:
    upstreams: [{dead}]
    fallback: {MODEL}
    tokenizer: {MODEL}
""")
    gw = ServerProcess("--router-config", str(config), "--poll-interval", "30", "--no-gateway",
                       "--expose-upstream-header", command="gateway")
    gw.wait_ready(60)  # ready: one group has a live replica
    try:
        for model in ("fast-model", MODEL, MODEL, "primary"):
            r = httpx.post(gw.url("/v1/completions"), json={"model": model, "prompt": "Hi", "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-ferrylm-upstream"] == replicas[1].base_url
        ids = [m["id"] for m in httpx.get(gw.url("/v1/models")).json()["data"]]
        assert set(ids) == {MODEL, "primary", "fast-model"}
        m = gw.metrics()
        assert sum(v for k, v in m.items() if k.startswith("ferrylm:router_fallbacks_total")) >= 1
    finally:
        stop(gw)


def _tenant_key(db: str) -> str:
    """A tenant `acme` (100k tokens/min, this model) in the state DB `db`, and an API key of it,
    made with the real `ferrylm tenants` / `ferrylm keys` commands."""

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "ferrylm.cli", *args, "--state-db", db], check=True,
                             capture_output=True, text=True)
        return out.stdout.strip().splitlines()[-1]

    cli("tenants", "create", "acme", "--tpm", "100000", "--models", MODEL)
    return cli("keys", "create", "--tenant", "acme")


def test_standalone_gateway_auth_limits_and_audit(replicas, tmp_path):
    db = f"sqlite:///{tmp_path}/state.db"
    key = _tenant_key(db)
    gw = start_gateway("--upstream", replicas[1].base_url, "--require-auth", "--state-db", db)
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3}
        assert httpx.post(gw.url("/v1/completions"), json=body).status_code == 401
        bad = httpx.post(gw.url("/v1/completions"), json=body, headers={"Authorization": "Bearer sk-wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(gw.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-tokens"] == "100000"
        with sqlite3.connect(f"{tmp_path}/state.db") as conn:
            rows = conn.execute("SELECT tenant, status, completion_tokens FROM audit_log").fetchall()
        assert ("acme", 200, 3) in rows, rows
    finally:
        stop(gw)


def _audit_rows(path: str, at_least: int, wait_s: float = 30.0) -> list[tuple]:
    """The audit log's rows once it holds `at_least` of them (or whatever it holds after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while True:
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT request_id, status, prompt_tokens, completion_tokens FROM audit_log").fetchall()
        if len(rows) >= at_least or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def test_gateway_routes_responses_tokenizer_and_model_endpoints(replicas, tmp_path):
    """/v1/responses (streamed and not, usage billed from the Responses shape), /tokenize,
    /detokenize, /v1/models/{id} and /version through an authenticating gateway."""
    db = f"sqlite:///{tmp_path}/state.db"
    key = _tenant_key(db)
    auth = {"Authorization": f"Bearer {key}"}
    gw = start_gateway("--upstream", replicas[0].base_url, "--require-auth", "--state-db", db)
    try:
        client = gw.client(api_key=key)
        direct = replicas[0].client().responses.create(model=MODEL, input="Name two rivers.", max_output_tokens=12,
                                                       temperature=0)
        via = client.responses.with_raw_response.create(model=MODEL, input="Name two rivers.", max_output_tokens=12,
                                                        temperature=0)
        body = via.parse()
        assert body.output_text == direct.output_text and body.usage.output_tokens == direct.usage.output_tokens
        events = list(client.responses.create(model=MODEL, input="Name two rivers.", max_output_tokens=12,
                                              temperature=0, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == direct.output_text
        final = events[-1]
        assert final.type in ("response.completed", "response.incomplete")
        assert final.response.usage.output_tokens == direct.usage.output_tokens
        # A relayed stream settles (bills) after its last event reached the client: wait for its row.
        rows = _audit_rows(f"{tmp_path}/state.db", 2)
        billed = {r[0]: r[1:] for r in rows}
        assert billed[via.headers["x-request-id"]] == (200, direct.usage.input_tokens, direct.usage.output_tokens)
        assert sorted(billed.values()).count((200, direct.usage.input_tokens, direct.usage.output_tokens)) == 2, rows
        # Responses fields are validated at the gateway with their own names.
        r = httpx.post(gw.url("/v1/responses"), json={"model": MODEL, "input": "x", "previous_response_id": "r1"},
                       headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        r = httpx.post(gw.url("/v1/responses"), json={"model": MODEL, "input": "x", "max_output_tokens": 0},
                       headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
        # Tokenizer endpoints: the replica's answer, behind the gateway's auth.
        tok = {"model": MODEL, "prompt": "Hello there", "return_token_strs": True}
        assert httpx.post(gw.url("/tokenize"), json=tok).status_code == 401
        via_tok = httpx.post(gw.url("/tokenize"), json=tok, headers=auth)
        assert via_tok.status_code == 200
        assert via_tok.json() == httpx.post(replicas[0].url("/tokenize"), json=tok).json()
        detok = httpx.post(gw.url("/detokenize"), json={"model": MODEL, "tokens": via_tok.json()["tokens"]},
                           headers=auth)
        assert detok.status_code == 200 and detok.json()["prompt"] == "Hello there"
        r = httpx.post(gw.url("/tokenize"), json={"model": "nope", "prompt": "x"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(gw.url("/detokenize"), json={"model": MODEL, "tokens": [-1]}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"], r.text
        assert client.models.retrieve(MODEL).id == MODEL
        r = httpx.get(gw.url("/v1/models/nope"), headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        version = httpx.get(gw.url("/version")).json()["version"]
        assert version and version == httpx.get(replicas[0].url("/version")).json()["version"]
    finally:
        stop(gw)


def test_sigterm_drains_proxied_streams_then_exits_zero(replicas):
    import signal
    import threading

    gw = start_gateway("--upstream", replicas[1].base_url, "--no-gateway")
    events: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = chat([{"role": "user", "content": "Describe a harbour at dawn."}], max_tokens=48, ignore_eos=True,
                    stream=True)
        with httpx.stream("POST", gw.url("/v1/chat/completions"), json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    gw.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(gw.url("/v1/completions"), json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                         timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    reader.join(120)
    assert gw.proc.wait(60) == 0, gw.log_tail()
    gw.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
