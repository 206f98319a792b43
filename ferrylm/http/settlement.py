"""Settle a request exactly once, however it ends. Both front doors (`ferrylm serve` and `ferrylm
gateway`) release limits, charge quotas, write the audit record, count the request and end its
trace through one Settlement: the first `settle` runs the callback with the status, every later
call (a close after the stream's end, an error after the answer settled) does nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Concatenate, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Settlement(Generic[P]):
    """The one end of one request: `status` is None until it settled, then the status it settled with."""

    def __init__(self, on_settle: Callable[Concatenate[int, P], Awaitable[None]]):
        self._on_settle = on_settle
        self.status: int | None = None

    @property
    def settled(self) -> bool:
        return self.status is not None

    async def settle(self, status: int, *args: P.args, **kwargs: P.kwargs) -> None:
        """Run the callback with `status` (and what the caller knows of the usage), the first time only."""
        if self.status is not None:
            return
        self.status = status
        await self._on_settle(status, *args, **kwargs)


class SettledStream(Generic[T]):
    """SSE events passed through, settling 200 when they end and 499 when the stream is closed
    first (client gone). A class, not an async generator, so that closing it settles even if it
    was never started (client gone before the first byte)."""

    def __init__(self, events: AsyncIterator[T], settlement: Settlement[[]]):
        self._events, self._settlement = events, settlement

    def __aiter__(self) -> SettledStream[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            await self._settlement.settle(200)
            raise

    async def aclose(self) -> None:
        try:
            await self._events.aclose()  # type: ignore[attr-defined]  # ours are async generators
        finally:
            await self._settlement.settle(499)
