"""Grammar compile workers forked from one ready process (grammar_fork_server.py): a worker killed
mid-compile is replaced by a fork, not by a process that imports xgrammar and torch again; the fork
server below the serving threads like its workers; a dead fork server is started again; nothing
outlives the compiler's shutdown."""

from __future__ import annotations

import json
import os
import time

import pytest

from ferrylm.model.background_priority import NICENESS
from ferrylm.model.structured import grammar_fork_server
from ferrylm.model.structured.grammar_worker import CompileCancelled, WorkerStartFailed
from tests.conftest import requires_smollm2

pytestmark = [requires_smollm2,
              pytest.mark.skipif(not grammar_fork_server.supported(), reason="the fork server is Linux's (pidfd)")]


@pytest.fixture(scope="module")
def info_json() -> str:
    import xgrammar

    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.grammar_worker import tokenizer_info_json
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    return tokenizer_info_json(xgrammar.TokenizerInfo.from_huggingface(tok.hf, vocab_size=len(tok.hf)))


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    """The process exited (a zombie counts: its memory is freed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_killed_worker_is_replaced_by_a_fork_of_the_same_ready_process(info_json: str) -> None:
    """Each worker is a child of the one fork server, running its image (same command line, never
    exec'd), below the serving threads; killing a worker mid-compile leaves the fork server, and the
    next worker compiles."""
    forks = grammar_fork_server.ForkServer(info_json, 0)
    try:
        first = forks.fork()
        first.wait_ready(60)
        server = forks.pid
        assert server is not None and _parent(first.pid) == server
        with open(f"/proc/{server}/cmdline", "rb") as a, open(f"/proc/{first.pid}/cmdline", "rb") as b:
            assert a.read() == b.read()
        assert os.getpriority(os.PRIO_PROCESS, first.pid) == NICENESS
        assert os.sched_getscheduler(first.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(server) == os.SCHED_IDLE
        assert first.compile("regex", "[a-z]{3}", True, 30.0, lambda: False)

        slow = json.dumps({"type": "object", "properties": {  # ~4 s to compile: stopped long before
            f"p{i}": {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"} for i in range(120)}})
        polls = iter(range(10**6))
        with pytest.raises(CompileCancelled):  # its waiter leaves mid-compile: the worker is killed
            first.compile("json", slow, True, 60.0, lambda: next(polls) > 3)
        assert not first.alive and _gone(first.pid)
        second = forks.fork()
        second.wait_ready(60)
        assert forks.pid == server and _parent(second.pid) == server
        assert second.compile("regex", "[0-9]+", True, 30.0, lambda: False)
        started = time.monotonic()
        second.kill()
        assert not second.alive and time.monotonic() - started < 1.0  # never waited on
    finally:
        forks.close()
    assert _gone(server)


def test_a_dead_fork_server_is_started_again_and_its_workers_keep_serving(info_json: str) -> None:
    forks = grammar_fork_server.ForkServer(info_json, 0)
    try:
        worker = forks.fork()
        worker.wait_ready(60)
        old = forks.pid
        assert old is not None
        os.kill(old, 9)
        assert _gone(old)
        assert worker.compile("regex", "a+", True, 30.0, lambda: False)  # its own channel, still served
        replacement = forks.fork()  # a new fork server
        replacement.wait_ready(120)
        assert forks.pid not in (None, old) and _parent(replacement.pid) == forks.pid
        assert replacement.compile("regex", "b+", True, 30.0, lambda: False)
        replacement.kill()
        worker.kill()
    finally:
        forks.close()


def test_the_compilers_shutdown_ends_the_fork_server_and_idle_workers() -> None:
    """GrammarCompiler forks its workers on Linux; after shutdown neither the fork server nor an idle
    worker is left, and no compile can start another."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.structured.structured_output import GrammarCompiler
    from ferrylm.sampling_params import StructuredOutputsParams as Spec
    from ferrylm.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model("smollm2-135m"))
    compiler = GrammarCompiler(tok.hf, len(tok.hf), tuple(tok.eos_token_ids))
    assert compiler.submit(Spec(regex="[a-z]{3}")).result(120) is not None
    assert compiler._forks is not None
    server, (worker,) = compiler._forks.pid, compiler._idle
    assert server is not None and _parent(worker.pid) == server
    compiler.shutdown()
    assert _gone(server) and _gone(worker.pid)
    with pytest.raises(WorkerStartFailed):
        compiler._new_worker()


def test_closing_while_the_fork_server_starts_fails_the_waiting_fork_at_once(info_json: str) -> None:
    """A fork waiting for the fork server's start (seconds: importing xgrammar) when the compiler shuts
    down gets WorkerStartFailed then, not after its start-up timeout."""
    import threading

    forks = grammar_fork_server.ForkServer(info_json, 0)
    outcome: list[BaseException | None] = []

    def fork() -> None:
        try:
            forks.fork(timeout_s=300).kill()
            outcome.append(None)
        except WorkerStartFailed as e:
            outcome.append(e)

    waiter = threading.Thread(target=fork)
    waiter.start()
    deadline = time.monotonic() + 30
    while forks.pid is None and time.monotonic() < deadline:
        time.sleep(0.01)
    forks.close()
    waiter.join(60)
    assert not waiter.is_alive() and len(outcome) == 1 and isinstance(outcome[0], WorkerStartFailed)
    with pytest.raises(WorkerStartFailed):
        forks.fork()
