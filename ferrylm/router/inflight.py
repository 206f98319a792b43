"""A proxied request the SIGTERM drain waits on until its answer is committed (the whole of a
non-streaming one). Within the drain timeout it simply finishes; past the deadline the drain
aborts it: the upstream try is cancelled (closing the connection makes the replica abort the
generation) and the client gets an OpenAI-style 503, not uvicorn's plain-text 500 when it
cancels the handler at exit."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from ferrylm.http.errors import APIError

T = TypeVar("T")


def shutting_down() -> APIError:
    return APIError(503, "The gateway is shutting down and the drain timeout passed before the answer was "
                         "ready; retry the request.", code="server_shutting_down", type_="server_error")


class InFlight:
    """One request in the drain's set; `guard(work)` runs the part that `abort()` may cut."""

    def __init__(self) -> None:
        self._aborted = asyncio.Event()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self) -> None:
        self._aborted.set()

    async def guard(self, work: Awaitable[T]) -> T:
        """`work`'s result, or APIError 503 if the drain aborts first (the work is cancelled and
        awaited, so its cleanup, closing the upstream response and the ticket, has run)."""
        if self.aborted:
            if asyncio.iscoroutine(work):
                work.close()  # never started: close it rather than leave it un-awaited
            raise shutting_down()
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self._aborted.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise shutting_down()
        return task.result()
