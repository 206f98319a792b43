"""A grammar compile in a child process, so it can be stopped: xgrammar's compile cannot be
interrupted inside a thread, and a schema built to compile for minutes would hold the compiler (and
a core) for everyone. The child runs below every serving thread (background_priority.py: decode
steps come first), compiles
one constraint at a time and sends back xgrammar's serialized CompiledGrammar; the parent kills it
when the compile's budget runs out or its last waiter left, and starts a fresh one for the next.
A worker says "ready" once xgrammar is imported and the tokenizer loaded (~4-5 s): a compile's
budget is counted from then, so a slow start never turns a small schema into a timeout."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from ferrylm.model.background_priority import background_python, yield_cpu_to_serving

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar and loading a 150k-token vocabulary on a loaded machine


class CompileTimeout(Exception):
    """The compile ran past its budget; the worker was killed."""


class WorkerStartFailed(Exception):
    """The worker process died or hung before it was ready."""


class CompileCancelled(Exception):
    """Nobody waits for the compile any more; the worker was killed."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    return json.loads(stream.read(int.from_bytes(head, "little")))


def _serve() -> None:
    """The child (`python -m ferrylm.model.structured.grammar_worker`): the tokenizer info first, then each
    [kind, payload, any_whitespace] → ["ok", serialized grammar] or ["error", message]."""
    yield_cpu_to_serving()
    import xgrammar

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        info = xgrammar.TokenizerInfo.deserialize_json(_recv(inp))
    except (EOFError, ValueError, RuntimeError):
        return  # the parent went away (or killed us) while sending the tokenizer
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _send(out, "ready")
    while True:
        try:
            kind, payload, any_whitespace = _recv(inp)
        except EOFError:
            return
        try:
            _send(out, ["ok", compile_one(compiler, kind, payload, any_whitespace).serialize_json()])
        except Exception as e:  # noqa: BLE001 - every compile error goes back as the request's 400
            _send(out, ["error", str(e)])


def compile_one(compiler: Any, kind: str, payload: str, any_whitespace: bool) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(payload, any_whitespace=any_whitespace)
    if kind == "json_object":  # OpenAI's json_object: any JSON object (not any JSON value)
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(payload)
    return compiler.compile_grammar(payload)


class CompileWorker:
    """One child process (a plain subprocess: no re-import of the caller's __main__, as
    multiprocessing's spawn would do); `compile` is called by one thread at a time. The constructor
    returns once the child has the tokenizer (the pipe takes it as the child reads); `wait_ready`
    waits for the child's "ready"."""

    def __init__(self, tokenizer_info_json: str):
        self._proc = subprocess.Popen(background_python("ferrylm.model.structured.grammar_worker"),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        self._ready = False
        try:
            _send(self._in, tokenizer_info_json)
        except OSError:
            pass  # it died at start: wait_ready says so

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Block until the child can compile; WorkerStartFailed (the child killed) if it cannot."""
        if self._ready:
            return
        if select.select([self._out], [], [], timeout_s)[0]:
            try:
                self._ready = _recv(self._out) == "ready"
            except (EOFError, ValueError):
                pass
        if not self._ready:
            self.kill()
            raise WorkerStartFailed()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def compile(self, kind: str, payload: str, any_whitespace: bool, budget_s: float,
                cancelled: Callable[[], bool]) -> str:
        """The serialized compiled grammar; ValueError for a grammar xgrammar refuses; CompileTimeout
        or CompileCancelled (the worker is dead then) when the budget ran out or nobody waits. The
        budget starts once the worker is ready."""
        try:
            self.wait_ready()
        except WorkerStartFailed:
            raise CompileTimeout() from None
        try:
            _send(self._in, [kind, payload, any_whitespace])
        except OSError:
            self.kill()
            raise CompileTimeout() from None
        deadline = time.monotonic() + budget_s
        while not select.select([self._out], [], [], 0.05)[0]:
            if cancelled():
                self.kill()
                raise CompileCancelled()
            if time.monotonic() > deadline or not self.alive:
                self.kill()
                raise CompileTimeout()
        try:
            status, value = _recv(self._out)
        except (EOFError, ValueError):
            self.kill()
            raise CompileTimeout() from None
        if status == "error":
            raise ValueError(value)
        return value

    def kill(self) -> None:
        if self.alive:
            self._proc.kill()
        self._proc.wait(5)
        self._in.close()
        self._out.close()


def tokenizer_info_json(info: Any) -> str:
    """What a child needs to rebuild the parent's TokenizerInfo (no HF tokenizer there)."""
    text = info.serialize_json()
    json.loads(text)  # fail here, not in the child, if xgrammar ever changes the format
    return text


if __name__ == "__main__":
    _serve()
