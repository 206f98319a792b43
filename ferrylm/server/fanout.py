"""Fanout: one API request's engine requests (n samples × prompts) read as one stream.

Each engine request is pumped by its own task into a shared queue, so the response sees outputs
in the order the engine produced them. Cancelling a pump closes its AsyncEngine iterator, which
aborts the engine request and frees its KV blocks: `aclose()` and `abort()` both rely on that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

from ferrylm.engine.llm import child_params
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput
from ferrylm.sampling_params import SamplingParams


class EngineClient(Protocol):
    """What the server needs of the engine (AsyncEngine implements it)."""

    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                          priority: int = 0) -> AsyncIterator[RequestOutput]: ...


class SequenceObserver(Protocol):
    """Told about each sequence's outputs as they arrive (latency metrics)."""

    def on_output(self, out: RequestOutput, now: float | None = None) -> None: ...

    def on_abort(self, now: float | None = None) -> None: ...


class FanoutRegistry(Protocol):
    """Keeps the in-flight Fanouts (so a draining server can wait for or abort them)."""

    def add(self, fanout: "Fanout") -> None: ...

    def discard(self, fanout: "Fanout") -> None: ...


class _Item(NamedTuple):
    index: int
    output: RequestOutput | None  # None: the sequence ended without finishing (aborted)
    error: BaseException | None


class Fanout:
    """Starts `len(prompts) * params.n` engine requests; choice i = prompt i // n, sample i % n."""

    def __init__(self, client: EngineClient, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int = 0, observer_factory: Callable[[], SequenceObserver] | None = None,
                 registry: FanoutRegistry | None = None):
        self.request_id = request_id
        self.prompts = prompts
        self.n = params.n
        self._client = client
        self._params = params
        self._priority = priority
        self._observer_factory = observer_factory
        self._registry = registry
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.last: dict[int, RequestOutput] = {}

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    async def start(self) -> None:
        """Submit every engine request; raises what the engine rejected (RequestRejected...), after
        aborting the siblings that were admitted."""
        if self._registry is not None:
            self._registry.add(self)
        jobs = [(index, child_params(self._params, index % self.n), self.prompts[index // self.n])
                for index in range(self.num_choices)]
        streams = await asyncio.gather(
            *(self._client.add_request(f"{self.request_id}-{i}", prompt, params, self._priority)
              for i, params, prompt in jobs), return_exceptions=True)
        failed = next((s for s in streams if isinstance(s, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(s.aclose() for s in streams if not isinstance(s, BaseException)))
            if self._registry is not None:
                self._registry.discard(self)
            raise failed
        self._tasks = [asyncio.create_task(self._pump(i, stream)) for (i, _, _), stream in zip(jobs, streams)]

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        observer = self._observer_factory() if self._observer_factory else None
        try:
            async for out in stream:
                if observer is not None:
                    observer.on_output(out, time.monotonic())
                self._queue.put_nowait(_Item(index, out, None))
        except asyncio.CancelledError:
            if observer is not None:
                observer.on_abort()  # no-op if it had finished
            self._queue.put_nowait(_Item(index, None, None))
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers the client
            self._queue.put_nowait(_Item(index, None, e))
            raise
        finally:
            await stream.aclose()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) until every sequence finished; aborted ones end with ABORT."""
        remaining = self.num_choices
        while remaining:
            item = await self._queue.get()
            if item.error is not None:
                raise item.error
            out = item.output if item.output is not None else self._aborted_output(item.index)
            self.last[item.index] = out
            yield item.index, out
            if out.finished:
                remaining -= 1

    def _aborted_output(self, index: int) -> RequestOutput:
        """A final output for a sequence cancelled before it finished: what it had, marked ABORT."""
        prev = self.last.get(index)
        if prev is None:
            completion = CompletionOutput(0, "", [], FinishReason.ABORT)
            return RequestOutput(f"{self.request_id}-{index}", None, self.prompts[index // self.n], [completion], True)
        c = prev.outputs[0]
        completion = CompletionOutput(0, c.text, list(c.token_ids), FinishReason.ABORT, logprobs=c.logprobs)
        return dataclasses.replace(prev, outputs=[completion], finished=True)

    def abort(self) -> None:
        """End every unfinished sequence now (server draining); the stream reports them as aborted."""
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel what is still running. The cancel is synchronous, so the engine requests are aborted
        even if this await is itself interrupted (a disconnect cancels the response's scope)."""
        for task in self._tasks:
            task.cancel()
        if self._registry is not None:
            self._registry.discard(self)
        await asyncio.gather(*self._tasks, return_exceptions=True)
