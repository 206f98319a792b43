"""Fanout: one API request's engine requests (n samples × prompts) read as one stream.

Each engine request is pumped by its own task into a shared queue, so the response sees outputs
in the order the engine produced them. Cancelling a pump closes its AsyncEngine iterator, which
aborts the engine request and frees its KV blocks: `aclose()` and `abort()` both rely on that.

Child ids, child params (seeds) and each choice's accumulated output come from
engine/parallel_sampling.py (one ParentRequest per prompt), as for the offline LLM. The engine
sends deltas and each choice's text, tokens and logprobs are kept once, so a consumer that falls
behind holds only what is unsent. That backlog is bounded: past `max_backlog` queued outputs (a
client reading too slowly) the queue is dropped, every sequence is aborted, and the consumer gets
StreamBacklogExceeded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple, Protocol

from ferrylm.engine.client import EngineClient, RequestStreamLike
from ferrylm.engine.parallel_sampling import ParentRequest
from ferrylm.http.errors import APIError
from ferrylm.outputs import CompletionOutput, FinishReason, RequestOutput
from ferrylm.sampling_params import SamplingParams


class SequenceObserver(Protocol):
    """Told about each sequence's outputs as they arrive (latency metrics)."""

    def on_output(self, out: RequestOutput, now: float | None = None) -> None: ...

    def on_abort(self, now: float | None = None) -> None: ...


class FanoutRegistry(Protocol):
    """Keeps the in-flight Fanouts (so a draining server can wait for or abort them)."""

    def add(self, fanout: "Fanout") -> None: ...

    def discard(self, fanout: "Fanout") -> None: ...


class _Item(NamedTuple):
    choice: int
    output: RequestOutput | None  # None: the sequence ended without finishing (aborted)
    error: BaseException | None


class StreamBacklogExceeded(APIError):
    """The client read its stream so slowly that too many outputs waited to be sent."""

    def __init__(self, limit: int):
        super().__init__(400, f"The stream was read too slowly: more than {limit} outputs waited to be sent, "
                              "so the request was aborted.", code="stream_backlog_exceeded")


class Fanout:
    """Starts `len(prompts) * params.n` engine requests; choice i = prompt i // n, sample i % n."""

    def __init__(self, client: EngineClient, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 priority: int = 0, observer_factory: Callable[[], SequenceObserver] | None = None,
                 registry: FanoutRegistry | None = None, max_backlog: int | None = None,
                 lora_name: str | None = None):
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
        # One parent per prompt; a lone prompt's children keep the plain `{request_id}-{i}` ids.
        self._parents = [ParentRequest(request_id if len(prompts) == 1 else f"{request_id}-{p}", params)
                         for p in range(len(prompts))]
        self._max_backlog = max_backlog
        self._lora_name = lora_name  # the LoRA adapter every engine request runs through
        self._overflowed = False

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def _parent(self, index: int) -> tuple[ParentRequest, int]:
        """Choice `index`'s parent (its prompt's) and its sample index within it."""
        return self._parents[index // self.n], index % self.n

    async def start(self) -> None:
        """Submit every engine request; raises what the engine rejected (RequestRejected...), after
        aborting the siblings that were admitted."""
        if self._registry is not None:
            self._registry.add(self)
        jobs = [(*self._parent(index), self.prompts[index // self.n]) for index in range(self.num_choices)]
        streams = await asyncio.gather(
            *(self._client.add_request(parent.child_id(j), prompt, parent.child_params(j), self._priority,
                                       ParentRequest.output_kind, lora_name=self._lora_name)
              for parent, j, prompt in jobs), return_exceptions=True)
        failed = next((s for s in streams if isinstance(s, BaseException)), None)
        if failed is not None:
            await asyncio.gather(*(s.aclose() for s in streams if not isinstance(s, BaseException)))
            if self._registry is not None:
                self._registry.discard(self)
            raise failed
        self._tasks = [asyncio.create_task(self._pump(i, stream)) for i, stream in enumerate(streams)
                       if not isinstance(stream, BaseException)]

    async def _pump(self, index: int, stream: RequestStreamLike) -> None:
        observer = self._observer_factory() if self._observer_factory else None
        try:
            async for out in stream:
                if observer is not None:
                    observer.on_output(out, time.monotonic())
                if self._overflowed:
                    break
                self._queue.put_nowait(_Item(index, out, None))
                if self._max_backlog is not None and self._queue.qsize() > self._max_backlog:
                    self._overflow()
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
        """Yield (choice index, this step's delta) until every sequence finished; aborted ones end
        with an ABORT delta. `final(i)` has the whole choice."""
        remaining = self.num_choices
        while remaining:
            item = await self._queue.get()
            if item.error is not None:
                raise item.error
            out = item.output if item.output is not None else self._aborted_output(item.choice)
            parent, j = self._parent(item.choice)
            parent.add(j, out)
            yield item.choice, out
            if out.finished:
                remaining -= 1

    def final(self, index: int) -> RequestOutput:
        """Choice `index` as one cumulative output (what it had, if it never finished)."""
        parent, j = self._parent(index)
        out = parent.child_output(j)
        return out if out is not None else self._aborted_output(index)

    def finals(self) -> list[RequestOutput]:
        return [self.final(i) for i in range(self.num_choices)]

    @property
    def num_completion_tokens(self) -> int:
        """Tokens the consumer has seen across every choice (what the request is billed)."""
        return sum(p.num_output_tokens for p in self._parents)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt once like its billing: per prompt
        the fewest any of its samples got (one of them computed what the others then found)."""
        total = 0
        for parent in self._parents:
            outs = [parent.child_output(j) for j in range(self.n)]
            got = [o.num_cached_tokens for o in outs if o is not None]
            total += min(got) if len(got) == self.n else 0
        return total

    def _aborted_output(self, index: int) -> RequestOutput:
        """The final delta of a sequence cancelled before it finished: nothing new, marked ABORT."""
        parent, j = self._parent(index)
        prev = parent.child_output(j)
        completion = CompletionOutput(j, "", [], FinishReason.ABORT,
                                      logprobs=[] if prev is not None and prev.outputs[0].logprobs is not None
                                      else None)
        if prev is None:
            return RequestOutput(parent.child_id(j), None, self.prompts[index // self.n], [completion], True)
        return dataclasses.replace(prev, outputs=[completion], finished=True)

    def _overflow(self) -> None:
        """Too much unsent: drop the backlog, abort every sequence, tell the consumer why."""
        self._overflowed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_Item(-1, None, StreamBacklogExceeded(self._max_backlog or 0)))
        self.abort()

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
