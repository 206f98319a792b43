"""Grammar compile workers forked from one process that has xgrammar imported and the tokenizer
loaded (a fork server, as multiprocessing's forkserver), instead of each started afresh.

A compile can only be stopped by killing its process, and a tenant can make that happen every
couple of seconds (a slow schema, abandoned). A worker started afresh imports xgrammar and torch
again: ~1.5 s of CPU and ~285 MB faulted in, and on a VM that hands freed memory back to its host
those pages come from the host each time. A forked worker is ready in milliseconds and shares the
fork server's pages until it writes to them. The fork server is the serving process's child; each
worker is the fork server's child, which reaps it. The serving process holds a pidfd per worker, so
a kill can never reach a process that merely reuses a dead worker's pid. Linux only (`supported`);
elsewhere grammar_worker.CompileWorker.spawn starts each worker afresh."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ferrylm.model.background_priority import background_python, yield_cpu_to_serving
from ferrylm.model.structured.grammar_worker import (
    STARTUP_TIMEOUT_S,
    CompileWorker,
    WorkerStartFailed,
    frame,
    serve_compiles,
)

MODULE = "ferrylm.model.structured.grammar_fork_server"


@functools.cache
def supported() -> bool:
    """Fork, pass a socket to another process, and watch a non-child's exit (pidfd: Linux 5.3+)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def _send(sock: socket.socket, message: Any) -> None:
    sock.sendall(frame(message))


def _recv_exact(sock: socket.socket, n: int, timeout_s: float | None) -> bytes:
    """Exactly n bytes, unbuffered (a fork request's file descriptor rides on the byte after them);
    EOFError if the peer closed, TimeoutError if nothing came for timeout_s."""
    data = b""
    while len(data) < n:
        if timeout_s is not None and not select.select([sock], [], [], timeout_s)[0]:
            raise TimeoutError
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _recv(sock: socket.socket, timeout_s: float | None = None) -> Any:
    size = int.from_bytes(_recv_exact(sock, 8, timeout_s), "little")
    return json.loads(_recv_exact(sock, size, timeout_s))


class ForkedProcess:
    """A forked worker seen from the serving process (the fork server's child, not ours): what
    CompileWorker uses of subprocess.Popen, through a pidfd. Its exit status is the fork server's to
    collect; poll and wait answer 0 once it exited."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = os.pidfd_open(pid)
        self._lock = threading.Lock()  # the reaping thread and `alive` may look at once

    def poll(self) -> int | None:
        with self._lock:
            if self._fd is not None and select.select([self._fd], [], [], 0)[0]:  # readable: it exited
                os.close(self._fd)
                self._fd = None
            return 0 if self._fd is None else None

    def kill(self) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    signal.pidfd_send_signal(self._fd, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited already

    def wait(self) -> int | None:
        while self.poll() is None:  # not a blocking select: poll may close the descriptor meanwhile
            time.sleep(0.05)
        return 0


class ForkServer:
    """The serving process's side: starts the fork server on first use (and again if it died) and
    forks ready workers from it. Thread-safe."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int):
        self._info_json, self._memory_bytes = tokenizer_info_json, memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._ready = self._closed = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def fork(self, timeout_s: float = STARTUP_TIMEOUT_S) -> CompileWorker:
        """A new worker (it says "ready" within milliseconds once the fork server is up: `wait_ready`).
        The first call waits for the fork server's start (~4-5 s: importing xgrammar); WorkerStartFailed
        if it cannot start or fork."""
        with self._lock:
            if self._closed:
                raise WorkerStartFailed()
            ours, theirs = socket.socketpair()
            try:
                control = self._running(timeout_s)
                with theirs:
                    socket.send_fds(control, [b"f"], [theirs.fileno()])
                pid = _recv(control, timeout_s)
                process = ForkedProcess(pid)
            except (OSError, EOFError, ValueError, TimeoutError):
                ours.close()
                theirs.close()  # not yet handed over when the fork server failed to start
                self._stop()
                raise WorkerStartFailed() from None
        to_child, from_child = ours.makefile("wb"), ours.makefile("rb")
        ours.close()  # the descriptor stays open until both streams are closed (CompileWorker.kill)
        return CompileWorker(process, to_child, from_child)

    def _running(self, timeout_s: float) -> socket.socket:
        """The control socket of a ready fork server, started if there is none or it died (caller
        holds the lock)."""
        if self._proc is not None and self._proc.poll() is not None:
            self._stop()
        if self._proc is None:
            ours, theirs = socket.socketpair()
            with theirs:  # the fork server's stdin is its end of the control socket
                self._proc = subprocess.Popen(background_python(MODULE, str(self._memory_bytes)),
                                              stdin=theirs.fileno(),
                                              stdout=subprocess.DEVNULL)
            ours.settimeout(timeout_s)  # a fork server that hangs fails a start instead of blocking it
            self._control, self._ready = ours, False
            _send(ours, self._info_json)
        assert self._control is not None
        if not self._ready:
            if _recv(self._control, timeout_s) != "ready":
                raise ValueError("the grammar fork server did not say ready")
            self._ready = True
        return self._control

    def _stop(self) -> None:
        """Kill the fork server (caller holds the lock). Its workers keep serving the compiles they
        have: each one's channel is its own."""
        if self._control is not None:
            self._control.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            threading.Thread(target=self._proc.wait, name="ferrylm-grammar-reap", daemon=True).start()
        self._proc, self._control, self._ready = None, None, False

    def close(self) -> None:
        """Stop the fork server; a fork waiting for it (its start) fails at once instead of holding
        the lock until its timeout."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        with self._lock:
            self._stop()


def _serve(memory_bytes: int) -> None:
    """The fork server (`python -m ferrylm.model.structured.grammar_fork_server MEMORY_BYTES`, its stdin
    the control socket): the tokenizer info, "ready", then a fork per request (one byte carrying the
    worker's end of its channel), answered with the worker's pid. Ends when the serving process
    closes the control socket."""
    yield_cpu_to_serving()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the server's terminal: it ends us, by EOF
    import xgrammar

    control = socket.socket(fileno=sys.stdin.fileno())
    try:
        info = xgrammar.TokenizerInfo.deserialize_json(_recv(control))
        _send(control, "ready")
        while True:
            readable = select.select([control], [], [], 1.0)[0]
            _reap()
            if not readable:
                continue
            message, fds, _, _ = socket.recv_fds(control, 1, 1)
            if not message:
                return
            if fds:
                _send(control, _fork_worker(control, fds[0], info, memory_bytes))
                os.close(fds[0])
    except (EOFError, OSError, ValueError, RuntimeError):
        return  # the serving process went away


def _fork_worker(control: socket.socket, channel_fd: int, info: Any, memory_bytes: int) -> int:
    """Fork a worker serving compiles on channel_fd; its pid (in the fork server)."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        control.close()
        channel = socket.socket(fileno=channel_fd)
        serve_compiles(info, memory_bytes, channel.makefile("rb"), channel.makefile("wb"))
    except BaseException:  # noqa: BLE001 - a forked child never returns into the fork server's loop
        code = 1
    finally:
        os._exit(code)


def _reap() -> None:
    """Collect every worker that exited (each was killed by the serving process or saw its channel
    close)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
