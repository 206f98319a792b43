"""Client disconnects: a request whose client has gone must stop using the engine.

Streaming responses close their event generator however they end (normal end, client gone,
server shutdown); non-streaming handlers race their work against the disconnect message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no caching, no proxy buffering


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    # After the body has been read, the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (so its cleanup aborts the engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that always closes its generator.

    Starlette cancels the sending task when the client disconnects, which can leave the generator
    suspended at a `yield` rather than closed; closing it here runs its cleanup (engine abort) now,
    not whenever the garbage collector gets to it.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # ours are async generators
