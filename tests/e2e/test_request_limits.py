"""M2.1 items 6, 7 and 9 on a real server behind the in-process gateway: requests that fail
validation still count toward requests/min (charged before the body is tokenized), a prompt that
cannot fit is refused before it is tokenized, prompts × n is capped, and each sequence counts
against the tenant's concurrency. A stream read too slowly (aborted with an explicit error once its
backlog passes --max-stream-backlog) is in tests/faults/test_single_replica.py."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess
from tests.e2e.test_gateway import ferrylm

pytestmark = requires_smollm2
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    db = f"sqlite:///{tmp_path_factory.mktemp('limits') / 'state.db'}"
    ferrylm("tenants", "create", "five", "--rpm", "5", db=db)
    ferrylm("tenants", "create", "narrow", "--max-concurrency", "4", db=db)
    ferrylm("tenants", "create", "open", db=db)
    keys = {t: ferrylm("keys", "create", "--tenant", t, db=db) for t in ("five", "narrow", "open")}
    server = ServerProcess("--model", MODEL, "--require-auth", "--state-db", db, "--max-num-seqs", "16",
                           "--max-sequences-per-request", "16", "--max-stream-backlog", "64")
    server.wait_ready()
    yield server, keys
    assert server.stop() == 0


def _post(server, key, path, body):
    return httpx.post(server.url(path), json={"model": MODEL, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_invalid_requests_count_toward_requests_per_minute(limited_server):
    server, keys = limited_server
    statuses = [_post(server, keys["five"], "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).status_code
                for _ in range(8)]
    assert statuses[:5] == [400] * 5
    assert statuses[5:] == [429] * 3


def test_huge_message_refused_before_tokenizing(limited_server):
    server, keys = limited_server
    r = _post(server, keys["open"], "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "word " * 800_000}], "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "at least" in error["message"]


def test_prompts_times_n_is_capped(limited_server):
    server, keys = limited_server
    r = _post(server, keys["open"], "/v1/completions", {"prompt": ["hi"] * 2000, "n": 8, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert r.json()["error"]["code"] == "too_many_sequences"
    r = _post(server, keys["open"], "/v1/completions", {"prompt": ["hi"] * 3, "n": 6, "max_tokens": 1})
    assert r.status_code == 400 and "18 sequences" in r.json()["error"]["message"]
    r = _post(server, keys["open"], "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hi"}], "n": 17, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = _post(server, keys["open"], "/v1/completions", {"prompt": ["hi"] * 2, "n": 8, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 16


def test_each_sequence_counts_against_concurrency(limited_server):
    server, keys = limited_server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _post(server, keys["narrow"], "/v1/chat/completions", {**chat, "n": 5})
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
    r = _post(server, keys["narrow"], "/v1/chat/completions", {**chat, "n": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_tokenizing_runs_off_the_event_loop(monkeypatch):
    """The template and tokenizer run in a worker thread, never on the event loop's thread."""
    from ferrylm.http import prompt_ids
    from ferrylm.http.protocol import ChatCompletionRequest, CompletionRequest
    from ferrylm.server import prompts

    threads: list[int] = []

    class FakeTokenizer:
        max_token_chars = 8

    monkeypatch.setattr(prompt_ids, "chat_prompt_ids", lambda *a: threads.append(threading.get_ident()) or [1])
    monkeypatch.setattr(prompt_ids, "completion_prompt_ids", lambda *a: threads.append(threading.get_ident()) or [[1]])

    async def run() -> int:
        chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
        await prompts.chat_prompt_ids(FakeTokenizer(), chat, 64)
        await prompts.completion_prompt_ids(FakeTokenizer(), CompletionRequest(prompt="hi"), 100, 64)
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(threads) == 2 and loop_thread not in threads


