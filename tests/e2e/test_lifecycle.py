"""Health, readiness, API keys and SIGTERM draining, on a server of its own started with test hooks
(FERRYLM_TEST_HOOKS=1 adds POST /debug/stall, which wedges the engine loop). SIGTERM runs last."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2

KEY = "sk-test-lifecycle"


def _statuses_while_loading(proc: ServerProcess) -> dict[str, int]:
    """/health, /ready and a chat request at the first moment the server answers (it listens before
    the model has loaded)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            health = httpx.get(proc.url("/health"), timeout=10).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
            continue
        chat = httpx.post(proc.url("/v1/chat/completions"), headers=proc.headers(), timeout=10,
                          json={"messages": [{"role": "user", "content": "Hi"}]})
        return {"health": health, "ready": httpx.get(proc.url("/ready"), timeout=10).status_code,
                "chat": chat.status_code, "chat_code": chat.json()["error"]["code"]}
    raise TimeoutError(proc.log_tail())


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--model", "smollm2-135m", "--ready-timeout", "1", "--heartbeat-timeout", "2",
                         "--drain-timeout", "60", "--served-model-name", "smol", "smollm2-135m",
                         env={"FERRYLM_TEST_HOOKS": "1"}, api_key=KEY)
    proc.while_loading = _statuses_while_loading(proc)
    proc.wait_ready()
    yield proc
    proc.stop()


def test_live_but_not_ready_while_loading(server):
    assert server.while_loading == {"health": 200, "ready": 503, "chat": 503, "chat_code": "model_loading"}


def test_api_key_required_on_v1_only(server):
    r = httpx.get(server.url("/v1/models"), timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url("/v1/models"), headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    r = httpx.get(server.url("/v1/models"), headers=server.headers(), timeout=10)
    assert [m["id"] for m in r.json()["data"]] == ["smol", "smollm2-135m"]
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
    resp = server.client().chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=2)
    assert resp.model == "smollm2-135m" and resp.usage.completion_tokens == 2


def test_ready_and_health_fail_while_engine_loop_stalled(server):
    assert httpx.get(server.url("/ready"), timeout=10).status_code == 200
    assert httpx.post(server.url("/debug/stall"), params={"seconds": 4}, timeout=10).status_code == 200
    r = httpx.get(server.url("/ready"), timeout=10)  # the one-token probe times out after 1 s
    assert r.status_code == 503, r.text
    time.sleep(1.5)  # the heartbeat is now older than --heartbeat-timeout 2
    assert httpx.get(server.url("/health"), timeout=10).status_code == 503
    assert httpx.get(server.url("/ready"), timeout=10).status_code == 503
    deadline = time.monotonic() + 20
    while httpx.get(server.url("/ready"), timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "not ready again after the stall"
        time.sleep(0.2)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def _stream_events(server, events: list, first_token: threading.Event) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, headers=server.headers(),
                      timeout=120) as r:
        for line in r.iter_lines():
            if line:
                events.append(line[len("data: "):])
                if len(events) >= 2:
                    first_token.set()


def test_sigterm_drains_in_flight_stream_then_exits_zero(server):
    events: list[str] = []
    first_token = threading.Event()
    reader = threading.Thread(target=_stream_events, args=(server, events, first_token))
    reader.start()
    assert first_token.wait(60), "stream never started"
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    r = httpx.post(server.url("/v1/chat/completions"), headers=server.headers(), timeout=10,
                   json={"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert httpx.get(server.url("/ready"), timeout=10).status_code == 503
    reader.join(120)
    assert server.proc.wait(60) == 0, server.log_tail()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["delta"].get("content", "")) > 0 for c in chunks) >= 30
