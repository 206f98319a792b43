"""`ferrylm gateway` in front of a real `ferrylm serve` replica, on its sharp edges: client errors
never trip the circuit breaker, a request without max_tokens reserves what the engine allows (the
tenant is refused as `ferrylm serve` refuses it), --metrics-require-auth on both front doors,
SIGTERM past the drain deadline answers a non-streaming request with an OpenAI-style 503, and
bodies that decode but cannot be forwarded get 400. One replica (auth on, so the gateway's
--upstream-api-key and its /load polling with it are exercised) for the module."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_gateway import ferrylm

pytestmark = requires_smollm2
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(replica, {tenant: key}, state db). The replica requires auth on /v1, /metrics and /load."""
    db = f"sqlite:///{tmp_path_factory.mktemp('gwh') / 'state.db'}"
    ferrylm("tenants", "create", "fleet", db=db)  # the gateway's own key: no limits on the replica
    ferrylm("tenants", "create", "acme", db=db)
    ferrylm("tenants", "create", "tight", "--tpm", "1000", db=db)
    ferrylm("tenants", "create", "roomy", "--tpm", "20000", db=db)
    keys = {t: ferrylm("keys", "create", "--tenant", t, db=db) for t in ("fleet", "acme", "tight", "roomy")}
    replica = ServerProcess("--model", MODEL, "--require-auth", "--state-db", db, "--metrics-require-auth",
                            "--max-num-seqs", "8")
    replica.wait_ready()
    yield replica, keys, db
    assert replica.stop() == 0, replica.log_tail()


def gateway(replica: ServerProcess, keys: dict[str, str], *args: str) -> ServerProcess:
    gw = ServerProcess("--upstream", replica.base_url, "--upstream-api-key", keys["fleet"], "--poll-interval", "0.25",
                       *args, command="gateway")
    gw.wait_ready(60)
    return gw


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(content: str = "Say hi.", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def test_client_errors_never_trip_the_breaker(fleet):
    replica, keys, db = fleet
    gw = gateway(replica, keys, "--require-auth", "--state-db", db)
    try:
        headers = bearer(keys["acme"])
        too_long = {"model": MODEL, "prompt": "x" * 40000, "max_tokens": 4}  # over the replica's context window
        direct = httpx.post(replica.url("/v1/completions"), json=too_long, headers=headers, timeout=60)
        assert direct.status_code == 400
        with httpx.Client(base_url=gw.base_url, headers=headers, timeout=60) as http:
            for i in range(5):  # more than the breaker's 3 consecutive failures
                r = http.post("/v1/completions", json=too_long | {"stream": bool(i % 2)})
                assert r.status_code == 400, r.text
                assert r.json() == direct.json(), "the replica's error body, passed through as it came"
            started = time.monotonic()
            ok = http.post("/v1/chat/completions", json=chat(max_tokens=2))
            assert ok.status_code == 200, ok.text  # at once: no `503 engine_unavailable`
            assert time.monotonic() - started < 10
        m = gw.metrics()
        labels = f"model_group={MODEL},replica={replica.base_url}"
        assert m[f"ferrylm:router_upstream_ejections{{{labels}}}"] == 0
        assert m[f"ferrylm:router_upstream_breaker_state{{{labels}}}"] == 0
        assert m[f"ferrylm:router_requests_total{{model_group={MODEL},status=400}}"] == 5
        assert not any(k.startswith("ferrylm:router_retries_total") and v for k, v in m.items()), "never retried"
    finally:
        assert gw.stop() == 0, gw.log_tail()


def _too_large_tokens(r: httpx.Response) -> int:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"
    return int(re.search(r"it may need (\d+) tokens", error["message"]).group(1))


def _remaining_after_stream_start(url: str, key: str) -> int:
    """x-ratelimit-remaining-tokens of a stream without max_tokens, read at its start (then closed)."""
    with httpx.stream("POST", url, json=chat(stream=True), headers=bearer(key), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return int(r.headers["x-ratelimit-remaining-tokens"])


def test_without_max_tokens_the_gateway_reserves_the_context_window_like_serve(fleet):
    replica, keys, db = fleet
    max_model_len = httpx.get(replica.url("/load"), headers=bearer(keys["fleet"]), timeout=10).json()["max_model_len"]
    assert max_model_len > 1000
    gw = gateway(replica, keys, "--require-auth", "--state-db", db)
    try:
        card = httpx.get(gw.url("/v1/models"), headers=bearer(keys["acme"]), timeout=10).json()["data"][0]
        assert card["max_model_len"] == max_model_len, "learnt from the replica's /load"
        # A --tpm 1000 tenant: prompt + the rest of the window is the whole window, too large for
        # the bucket. `ferrylm serve` refuses it; the gateway must too, with the same count.
        direct = httpx.post(replica.url("/v1/chat/completions"), json=chat(), headers=bearer(keys["tight"]),
                            timeout=60)
        via = httpx.post(gw.url("/v1/chat/completions"), json=chat(), headers=bearer(keys["tight"]), timeout=60)
        assert _too_large_tokens(via) == _too_large_tokens(direct) == max_model_len
        with_max = httpx.post(gw.url("/v1/chat/completions"), json=chat(max_tokens=8), headers=bearer(keys["tight"]),
                              timeout=60)
        assert with_max.status_code == 200, with_max.text
        # A tenant it fits: the reservation is exactly the window, on either front door (their
        # buckets are per process, each starting full).
        for url in (gw.url("/v1/chat/completions"), replica.url("/v1/chat/completions")):
            remaining = _remaining_after_stream_start(url, keys["roomy"])
            assert 20000 - max_model_len <= remaining <= 20000 - max_model_len + 20, (url, remaining)
    finally:
        assert gw.stop() == 0, gw.log_tail()


def test_metrics_require_auth_on_serve_and_gateway(fleet):
    replica, keys, db = fleet
    for path in ("/metrics", "/load"):
        assert httpx.get(replica.url(path), timeout=10).status_code == 401
        assert httpx.get(replica.url(path), headers=bearer("fl-nope-nope"), timeout=10).status_code == 401
        assert httpx.get(replica.url(path), headers=bearer(keys["acme"]), timeout=10).status_code == 200
    assert httpx.get(replica.url("/health"), timeout=10).status_code == 200
    locked = gateway(replica, keys, "--state-db", db, "--metrics-require-auth")
    open_ = gateway(replica, keys, "--no-gateway")
    try:
        r = httpx.get(locked.url("/metrics"), timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert replica.base_url not in r.text
        r = httpx.get(locked.url("/metrics"), headers=bearer(keys["acme"]), timeout=10)
        assert r.status_code == 200 and replica.base_url in r.text
        # The replica's /load needs the gateway's key: polled with --upstream-api-key, it stays up.
        assert re.search(r"ferrylm:router_upstream_healthy\{[^}]*\} 1\.0", r.text), r.text
        r = httpx.get(open_.url("/metrics"), timeout=10)
        assert r.status_code == 200 and replica.base_url in r.text, "open by default, as vLLM's /metrics"
    finally:
        assert locked.stop() == 0, locked.log_tail()
        assert open_.stop() == 0, open_.log_tail()


def test_bodies_that_cannot_be_forwarded_are_400(fleet):
    replica, keys, _ = fleet
    gw = gateway(replica, keys, "--no-gateway")
    try:
        bodies = ['{"model":"' + MODEL + '","messages":[{"role":"user","content":"\\ud800"}]}',
                  '{"model":"' + MODEL + '","prompt":"hi","x":' + "[" * 100_000 + "]" * 100_000 + "}"]
        for body, path in zip(bodies, ("/v1/chat/completions", "/v1/completions")):
            r = httpx.post(gw.url(path), content=body, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert httpx.post(gw.url("/v1/chat/completions"), json=chat(max_tokens=2), timeout=60).status_code == 200
    finally:
        assert gw.stop() == 0, gw.log_tail()


def test_sigterm_past_the_drain_deadline_answers_json_503_and_finishes_the_short_request(fleet):
    replica, keys, _ = fleet
    # 10 s: the 8-token request must finish within it on the slowest CPU CI runs on (4 s did not on an
    # AVX2-only machine, eager, next to a 4000-token stream); the long one is cut either way.
    gw = gateway(replica, keys, "--no-gateway", "--drain-timeout", "10")
    answers: dict[str, httpx.Response] = {}

    def post(name: str, max_tokens: int) -> None:
        body = chat("Tell me a long story about a ferry.", max_tokens=max_tokens, ignore_eos=True)
        answers[name] = httpx.post(gw.url("/v1/chat/completions"), json=body, timeout=120)

    threads = [threading.Thread(target=post, args=("short", 8)), threading.Thread(target=post, args=("long", 4000))]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while "short" not in answers and sum(v for k, v in gw.metrics().items()
                                             if k.startswith("ferrylm:router_upstream_in_flight_requests")) < 2:
            assert time.monotonic() < deadline, "requests never reached the replica"
            time.sleep(0.02)
        sent = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert gw.proc.wait(30) == 0, gw.log_tail()
        assert time.monotonic() - sent < 30
        assert answers["short"].status_code == 200, "in flight within the drain timeout: it finishes"
        assert answers["short"].json()["usage"]["completion_tokens"] == 8
        cut = answers["long"]
        assert cut.status_code == 503 and cut.headers["content-type"].startswith("application/json"), cut.text
        assert cut.json()["error"]["code"] == "server_shutting_down"
        # The replica stopped generating for it (the gateway closed the upstream connection).
        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(replica.url("/metrics"), headers=bearer(keys["fleet"]), timeout=10).text
            if re.search(r"^ferrylm:num_requests_running\{[^}]*\} 0\.0$", text, re.M):
                break
            assert time.monotonic() < deadline, "the replica still runs the cut request"
            time.sleep(0.2)
    finally:
        gw.stop()
