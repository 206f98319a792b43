"""A grammar compile in a child process, so it can be stopped: xgrammar's compile cannot be
interrupted inside a thread, and a schema built to compile for minutes would hold the compiler (and
a core) for everyone. The child runs below every serving thread (background_priority.py: decode
steps come first), compiles one constraint at a time and sends back xgrammar's serialized
CompiledGrammar; the parent kills it when the compile's budget runs out or its last waiter left,
and another takes its place for the next. On Linux children are forked from a process that has
xgrammar imported and the tokenizer loaded (grammar_fork_server.py: ready in milliseconds);
elsewhere each is started afresh (`CompileWorker.spawn`) and says "ready" once it has imported
xgrammar and loaded the tokenizer (~4-5 s). A compile's budget is counted from "ready", so a slow
start never turns a small schema into a timeout."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Protocol

from ferrylm.model.background_priority import background_python, yield_cpu_to_serving

STARTUP_TIMEOUT_S = 120.0  # importing xgrammar and loading a 150k-token vocabulary on a loaded machine


class CompileTimeout(Exception):
    """The compile ran past its budget; the worker was killed."""


class WorkerStartFailed(Exception):
    """The worker process died or hung before it was ready."""


class CompileCancelled(Exception):
    """Nobody waits for the compile any more; the worker was killed."""


class CompileOutOfMemory(Exception):
    """The compile wanted more memory than the worker's cap (cap_memory)."""


def frame(message: Any) -> bytes:
    """A message on the wire between the serving process and a worker (or the fork server): its
    JSON's length in 8 little-endian bytes, then the JSON."""
    data = json.dumps(message).encode()
    return len(data).to_bytes(8, "little") + data


def _send(stream: IO[bytes], message: Any) -> None:
    stream.write(frame(message))
    stream.flush()


def _recv(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    return json.loads(stream.read(int.from_bytes(head, "little")))


def _serve(memory_bytes: int) -> None:
    """A worker started afresh (`python -m ferrylm.model.structured.grammar_worker MEMORY_BYTES`): the
    tokenizer info first, then `serve_compiles`."""
    yield_cpu_to_serving()
    import xgrammar

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        info = xgrammar.TokenizerInfo.deserialize_json(_recv(inp))
    except (EOFError, ValueError, RuntimeError):
        return  # the parent went away (or killed us) while sending the tokenizer
    serve_compiles(info, memory_bytes, inp, out)


def serve_compiles(info: Any, memory_bytes: int, inp: IO[bytes], out: IO[bytes]) -> None:
    """A worker's life once it has the tokenizer (xgrammar.TokenizerInfo): "ready", then each
    [kind, payload, any_whitespace] → ["ok", serialized grammar], ["error", message] or ["memory", ""]
    (the compile wanted more than `memory_bytes` beyond the ready worker's), until `inp` ends."""
    import xgrammar

    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    cap_memory(memory_bytes)
    _send(out, "ready")
    while True:
        try:
            kind, payload, any_whitespace = _recv(inp)
        except EOFError:
            return
        try:
            _send(out, ["ok", compile_one(compiler, kind, payload, any_whitespace).serialize_json()])
        except Exception as e:  # noqa: BLE001 - every compile error goes back as the request's 400
            # past cap_memory: Python's MemoryError, or xgrammar's C++ std::bad_alloc as its message
            _send(out, ["memory", ""] if isinstance(e, MemoryError) or "bad_alloc" in str(e) else ["error", str(e)])


def cap_memory(memory_bytes: int) -> None:
    """Let this process's data (heap and private mappings: RLIMIT_DATA) grow by at most `memory_bytes`
    from now (0: no cap). A compile past it fails with MemoryError. Bounds what one constraint takes
    from the host: a 120-property schema of regex strings grew a worker by ~850 MB and 1,000 plain
    string properties by 5 GB (RESULTS, "M3.2 grammar compile memory")."""
    if memory_bytes <= 0 or not sys.platform.startswith("linux"):
        return  # elsewhere RLIMIT_DATA does not cover mmap'd memory (or there is no /proc to read)
    import resource

    try:
        with open("/proc/self/status") as status:
            data_kib = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    soft = data_kib * 1024 + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def compile_one(compiler: Any, kind: str, payload: str, any_whitespace: bool) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(payload, any_whitespace=any_whitespace)
    if kind == "json_object":  # OpenAI's json_object: any JSON object (not any JSON value)
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(payload)
    return compiler.compile_grammar(payload)


class WorkerProcess(Protocol):
    """What CompileWorker needs of its child: subprocess.Popen's, or a forked child's seen through
    a pidfd (grammar_fork_server.ForkedProcess)."""

    pid: int

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> int | None: ...


class CompileWorker:
    """One child process, talked to over two byte streams; `compile` is called by one thread at a
    time. `wait_ready` waits for the child's "ready"."""

    def __init__(self, process: WorkerProcess, to_child: IO[bytes], from_child: IO[bytes]):
        self._proc, self._in, self._out = process, to_child, from_child
        self._ready = self._killed = False

    @classmethod
    def spawn(cls, tokenizer_info_json: str, memory_bytes: int = 0) -> CompileWorker:
        """A worker started afresh (a plain subprocess: no re-import of the caller's __main__, as
        multiprocessing's spawn would do). Returns once the child has the tokenizer (the pipe takes
        it as the child reads)."""
        proc = subprocess.Popen(background_python("ferrylm.model.structured.grammar_worker", str(memory_bytes)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        worker = cls(proc, proc.stdin, proc.stdout)
        try:
            _send(proc.stdin, tokenizer_info_json)
        except OSError:
            pass  # it died at start: wait_ready says so
        return worker

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
        return not self._killed and self._proc.poll() is None

    def compile(self, kind: str, payload: str, any_whitespace: bool, budget_s: float,
                cancelled: Callable[[], bool]) -> str:
        """The serialized compiled grammar; ValueError for a grammar xgrammar refuses; CompileTimeout
        or CompileCancelled (the worker is dead then, unless nobody waited before the compile began)
        when the budget ran out or nobody waits; CompileOutOfMemory past the worker's memory cap. The
        budget starts once the worker is ready."""
        try:
            self.wait_ready()
        except WorkerStartFailed:
            raise CompileTimeout() from None
        if cancelled():  # its waiter left while a worker started: this one stays ready for the next
            raise CompileCancelled()
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
        if status == "memory":
            raise CompileOutOfMemory()
        if status == "error":
            raise ValueError(value)
        return value

    def kill(self) -> None:
        """SIGKILL the child and reap it in the background: under SCHED_IDLE on a busy machine a
        killed child can wait seconds for the CPU time its exit needs (freeing its memory)."""
        self._killed = True
        if self._proc.poll() is None:
            self._proc.kill()
        for stream in (self._in, self._out):
            try:
                stream.close()
            except OSError:
                pass  # buffered bytes to a dead child
        if self._proc.poll() is None:
            threading.Thread(target=self._proc.wait, name="ferrylm-grammar-reap", daemon=True).start()


def tokenizer_info_json(info: Any) -> str:
    """What a child needs to rebuild the parent's TokenizerInfo (no HF tokenizer there)."""
    text = info.serialize_json()
    json.loads(text)  # fail here, not in the child, if xgrammar ever changes the format
    return text


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
