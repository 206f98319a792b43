"""AsyncEngine: the EngineClient the server uses. The engine loop runs in its own thread; each
request gets an asyncio queue of RequestOutputs; closing or cancelling the consumer aborts it.

A caller's request id (the client's X-Request-Id, say) is only a label: the engine keys every
request by an internal id minted here, unique for the engine's lifetime, so no client can collide
with another's request or with the readiness probe (vLLM separates external and internal ids).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from ferrylm.engine.adapters import LoRAInfo
from ferrylm.engine.client import EngineDeadError, ModelInfo
from ferrylm.engine.engine import Engine
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.engine.short_lived_thread import run_in_short_lived_thread, settle_threadsafe
from ferrylm.kv_transfer import KVBlocks
from ferrylm.load_report import LoadReport
from ferrylm.outputs import RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("ferrylm.engine")
__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]


class _Add(NamedTuple):
    request_id: str  # the internal key
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future
    output_kind: RequestOutputKind
    lora_name: str | None = None


class _Call(NamedTuple):
    """Work on the engine itself (KV transfer, adapters) that the loop thread runs between steps."""

    work: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


class AsyncEngine:
    """Thread-backed engine loop. Torch releases the GIL in kernels, so the event loop stays responsive.

    A thread (not a process) because outputs then need no serialisation and the CPU forward pass
    already releases the GIL; a step costs tens of milliseconds, the hand-off microseconds.
    Callers never take the engine lock: adds and aborts are queued and applied by the loop thread
    between steps (as vLLM's engine core does), so the event loop never waits for a step.

    Only the loop thread runs the model's torch work once it started (KV transfer and adapter loads
    too, as _Call commands): every thread that runs a parallel region keeps an OpenMP pool for its
    life, and with more pooled threads than CPUs libgomp stops spinning between regions, so each of a
    decode step's hundreds of regions sleeps and wakes its threads (short_lived_thread.py).
    """

    def __init__(self, engine: Engine, idle_wait_s: float = 0.5):
        self.engine = engine  # for tests and tools; the server reads model_info instead
        self.model_info = ModelInfo(engine.config.model, engine.tokenizer, engine.vocab_size, engine.max_model_len,
                                    engine.config.cache.block_size)
        self._lock = threading.Lock()  # held by the loop around each step; for tests and tools
        self._commands: collections.deque[_Add | _Call | str] = collections.deque()  # in arrival order
        self._pending_lock = threading.Lock()  # guards only the counters below
        self._pending_adds = 0
        self._pending_tokens = 0
        self._pending_output = 0
        self._pending_certain = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # by internal key
        self._keys = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop_ended = False
        self._idle_wait_s = idle_wait_s
        self._stall_until = 0.0
        self.heartbeat = time.monotonic()
        self.error: BaseException | None = None
        self._stats = engine.stats()

    def check_invariants(self) -> None:
        """Consistency of the queued work and the open streams; call when no add_request is
        between its two steps (tests call it after awaiting every operation)."""
        with self._lock:  # the loop is between steps
            adds = [c for c in self._commands if isinstance(c, _Add)]
            with self._pending_lock:
                counts = (self._pending_adds, self._pending_tokens, self._pending_output, self._pending_certain)
            if counts[0] != len(adds) or min(counts) < 0:
                raise AssertionError(f"pending counters {counts} but {len(adds)} queued adds")
            for key in self._queues:
                label, _, seq = key.rpartition("#")
                if not seq.isdigit():
                    raise AssertionError(f"stream key {key!r} was not minted by this engine")
            check = getattr(self.engine, "check_invariants", None) or getattr(
                getattr(self.engine, "scheduler", None), "check_invariants", None)
            if check is not None:
                check()

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ferrylm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        stop_ranks = getattr(self.engine, "shutdown", None)  # tensor-parallel ranks, if the engine has any
        if stop_ranks is not None and (self._thread is None or not self._thread.is_alive()):
            stop_ranks()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def errored(self) -> bool:
        return self.error is not None

    async def check_health(self) -> None:
        """Raise EngineDeadError if the loop crashed (a tensor-parallel rank that exited crashes it) or
        is not running."""
        if not self.is_running:
            raise EngineDeadError(f"engine loop not running: {self.error!r}")

    def seconds_since_heartbeat(self) -> float:
        return time.monotonic() - self.heartbeat

    def stall_for(self, seconds: float) -> None:
        """Test hook: make the loop hang (as a wedged kernel would) for `seconds`."""
        self._stall_until = time.monotonic() + seconds
        self._wake.set()

    def stats(self) -> LoadReport:
        """The snapshot taken after the last step, plus requests queued for admission since (so a
        burst is visible to admission control before the loop gets to it). Never blocks on a step."""
        with self._pending_lock:
            pending, tokens, output = self._pending_adds, self._pending_tokens, self._pending_output
            certain = self._pending_certain
        if not pending:
            return self._stats
        s = self._stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + pending,
                                   num_waiting_prompt_tokens=s.num_waiting_prompt_tokens + tokens,
                                   num_waiting_output_tokens=s.num_waiting_output_tokens + output,
                                   num_waiting_certain_output_tokens=s.num_waiting_certain_output_tokens + certain)

    def _count_pending(self, command: _Add, sign: int) -> None:
        prompt_len = len(command.prompt) if isinstance(command.prompt, list) else 0
        output = self.engine.resolve_max_tokens(command.params, prompt_len)
        certain = output if command.params.ignore_eos else min(output, command.params.min_tokens)
        with self._pending_lock:
            self._pending_certain += sign * certain
            self._pending_adds += sign
            self._pending_tokens += sign * prompt_len
            self._pending_output += sign * output

    # -- requests ------------------------------------------------------------------------
    def _new_key(self, request_id: str) -> str:
        """A key no other request of this engine has had: the caller's label plus a sequence number
        after the last '#' (the number alone is unique, so keys can never collide)."""
        return f"{request_id}#{next(self._keys)}"

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                          lora_name: str | None = None) -> "RequestStream":
        """Admit a request and return its output stream; raises RequestRejected / SamplingParamsError.

        `request_id` labels the outputs and may repeat across requests. Closing the stream before it
        finished (client gone, task cancelled, sibling rejected) aborts the request and frees its KV
        blocks, even if the stream was never iterated.
        """
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        admitted = loop.create_future()
        key = self._new_key(request_id)
        self._queues[key] = (loop, queue)
        command = _Add(key, prompt, params, priority, loop, admitted, output_kind, lora_name)
        self._count_pending(command, +1)
        self._commands.append(command)
        self._wake.set()
        try:
            await admitted
        except BaseException:
            self._queues.pop(key, None)
            self.abort(key)  # no-op if it was rejected; needed if we were cancelled
            raise
        return RequestStream(self, key, request_id, queue)

    async def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None) -> bytes:
        """kv_transfer wire bytes of the cached full blocks of `token_ids` (taken between steps)."""
        kv = await self._between_steps(lambda: self.engine.export_prefix_kv(token_ids, cache_salt))
        return await run_in_short_lived_thread(kv.to_bytes)

    async def import_prefix_kv(self, body: bytes) -> int:
        """Cache the blocks of a kv_transfer body here (between steps); the number written. Raises
        ValueError for a bad body or hashes, kv_transfer.KVLayoutMismatch for another layout."""
        kv = await run_in_short_lived_thread(lambda: KVBlocks.from_bytes(body))
        return await self._between_steps(lambda: self.engine.import_prefix_kv(kv))

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Load (or replace) the adapter `name` between steps; raises LoRAError / AdapterBusy."""
        return await self._between_steps(lambda: self._restat(self.engine.adapters.add(name, path)))

    async def unload_lora(self, name: str) -> None:
        """Forget `name` between steps; KeyError if not loaded, AdapterBusy while its requests run."""
        def unload() -> None:
            self.engine.adapters.remove(name)
            self._restat(None)

        await self._between_steps(unload)

    def _restat(self, result: LoRAInfo | None) -> LoRAInfo | None:
        """`result`, once the stats snapshot is retaken (else an idle loop leaves /load's adapters stale)."""
        self._stats = self.engine.stats()
        return result

    def lora_adapters(self) -> list[LoRAInfo]:
        return self.engine.adapters.list()

    async def _between_steps(self, work: Callable[[], Any]) -> Any:
        """`work`'s result, run by the loop thread between two steps (before the loop starts: on a
        short-lived thread, under the lock)."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        if self._thread is None:
            def locked() -> Any:
                with self._lock:
                    return work()
            return await run_in_short_lived_thread(locked)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.append(_Call(work, loop, done))
        self._wake.set()
        if self._loop_ended:  # the loop may have drained its commands before this one arrived
            self._fail_calls()
        return await done

    def _fail_calls(self) -> None:
        """Fail every queued _Call: the loop has ended and will not run them."""
        error = EngineDeadError(f"engine loop not running: {self.error!r}")
        for command in list(self._commands):
            if isinstance(command, _Call):
                try:
                    self._commands.remove(command)
                except ValueError:
                    continue  # the other side took it
                settle_threadsafe(command.loop, command.done, error)

    async def prepare_structured_output(self, spec: StructuredOutputsParams) -> None:
        """Wait for the constraint's grammar (compiled on the compiler's worker thread, cached, so the
        request's own add is a cache hit); raises its StructuredOutputError."""
        grammars = self.engine.grammars
        if grammars is None:
            raise RequestRejected("structured output is not available on this engine", spec.param)
        future = grammars.submit(spec, waiting=True)
        try:
            await asyncio.shield(asyncio.wrap_future(future))  # never cancel the shared compile itself
        except asyncio.CancelledError:  # the client left: a compile nobody else waits for is stopped
            grammars.release(spec)
            raise

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: rejections surface at the first iteration."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def _release(self, key: str, finished: bool) -> None:
        """A stream is done with `key`: stop delivering to it, and abort it if it had not finished."""
        self._queues.pop(key, None)
        if not finished:
            self.abort(key)

    def abort(self, key: str) -> None:
        """Cancel a request by its internal key (RequestStream.key) from any thread without
        blocking; applied before the next step. A stream still reading gets a final "abort" output."""
        self._commands.append(key)
        self._wake.set()

    def _apply_commands(self) -> None:
        """Admit queued requests and apply aborts, in arrival order (loop thread, under the lock)."""
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, str):
                out = self.engine.abort(command)
                if out is not None:
                    self._deliver([out])
                continue
            if isinstance(command, _Call):
                try:
                    result = command.work()
                except Exception as e:  # noqa: BLE001 - the caller's error (a bad import, a busy adapter)
                    settle_threadsafe(command.loop, command.done, e)
                else:
                    settle_threadsafe(command.loop, command.done, None, result)
                continue
            self._count_pending(command, -1)
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params, command.priority,
                                        output_kind=command.output_kind, lora_name=command.lora_name)
            except Exception as e:  # noqa: BLE001 - a rejection belongs to the caller, not the loop
                settle_threadsafe(command.loop, command.admitted, e)
            else:
                settle_threadsafe(command.loop, command.admitted, None)

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                if self._stall_until > time.monotonic():
                    time.sleep(self._stall_until - time.monotonic())
                    continue
                if not self._commands and not self.engine.has_unfinished_requests():
                    self._fail_if_a_rank_died()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
                    continue
                with self._lock:
                    self._apply_commands()
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting stream
            log.exception("engine loop crashed")
            self.error = e
            for loop, queue in list(self._queues.values()):
                loop.call_soon_threadsafe(queue.put_nowait, e)
            while self._commands:
                command = self._commands.popleft()
                if isinstance(command, _Add):
                    settle_threadsafe(command.loop, command.admitted, EngineDeadError(f"engine loop died: {e!r}"))
                elif isinstance(command, _Call):
                    settle_threadsafe(command.loop, command.done, EngineDeadError(f"engine loop died: {e!r}"))
        finally:
            self._loop_ended = True
            self._fail_calls()

    def _fail_if_a_rank_died(self) -> None:
        """Idle, a tensor-parallel engine still checks its ranks: one that exited fails the loop now
        (liveness turns 503), not at the next request."""
        reason = self.engine.executor_dead()
        if reason:
            raise RuntimeError(f"{reason}; the engine cannot continue without it")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                loop, queue = target
                loop.call_soon_threadsafe(queue.put_nowait, out)


class RequestStream:
    """One request's outputs, in order; `aclose()` aborts the request unless it finished.

    A class rather than an async generator: closing a generator that never started runs none of
    its code, so siblings of a rejected request would keep generating unseen (and unbilled).
    Outputs carry the caller's request id, not the internal key.
    """

    def __init__(self, engine: AsyncEngine, key: str, request_id: str, queue: asyncio.Queue):
        self.key = key
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._close()
            raise EngineDeadError(f"engine loop died: {item!r}")
        if item.finished:
            self._finished = True
            self._close()
        return dataclasses.replace(item, request_id=self.request_id)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._release(self.key, self._finished)

    async def aclose(self) -> None:
        self._close()
