"""AsyncEngine: the EngineClient the server uses. The engine loop runs in its own thread; each
request gets an asyncio queue of RequestOutputs; cancelling the consumer aborts the request."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from ferrylm.engine.engine import Engine, EngineStats
from ferrylm.outputs import RequestOutput
from ferrylm.sampling_params import SamplingParams

log = logging.getLogger("ferrylm.engine")


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server answers 503 until restarted."""


class AsyncEngine:
    """Thread-backed engine loop. Torch releases the GIL in kernels, so the event loop stays responsive.

    A thread (not a process) because outputs then need no serialisation and the CPU forward pass
    already releases the GIL; a step costs tens of milliseconds, the hand-off microseconds.
    """

    def __init__(self, engine: Engine, idle_wait_s: float = 0.5):
        self.engine = engine
        self._lock = threading.Lock()  # guards every Engine call (the engine is not thread-safe)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
        self._stall_until = 0.0
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._stats = engine.stats()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ferrylm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def seconds_since_heartbeat(self) -> float:
        return time.monotonic() - self.heartbeat

    def stall_for(self, seconds: float) -> None:
        """Test hook: make the loop hang (as a wedged kernel would) for `seconds`."""
        self._stall_until = time.monotonic() + seconds
        self._wake.set()

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (no lock: never blocks the caller)."""
        return self._stats

    # -- requests ------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; raises RequestRejected / SamplingParamsError at once.

        If the consumer stops early (client gone, task cancelled) the request is aborted and its
        KV blocks are freed.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        try:
            with self._lock:
                self.engine.add_request(request_id, prompt, params, priority)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine loop died: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort(request_id)
            self._stats = self.engine.stats()

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                if self._stall_until > time.monotonic():
                    time.sleep(self._stall_until - time.monotonic())
                    continue
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                with self._lock:
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting stream
            log.exception("engine loop crashed")
            self.error = e
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, e)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)
