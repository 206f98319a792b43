"""Run torch work off the event loop on a thread that ends with it, not on asyncio's pooled threads.

libgomp (torch's OpenMP on Linux) gives every thread that runs a parallel region a pool of worker
threads, kept until that thread exits. Once the pooled threads outnumber the CPUs, libgomp stops
spinning at its barriers (its "throttled" spin count) and every parallel region sleeps and wakes its
threads instead. A decode step runs hundreds of regions, so one load or KV copy on an
`asyncio.to_thread` worker (which lives on) made every later step of the engine thread pay that:
on a 2-CPU machine a small matmul took 35% longer with ~4 context switches each, and each of those
wake-ups waited for whatever else held the CPU (a grammar compile, another tenant's request
handling). A thread that exits frees its pool, so the engine thread stays the only one with a team
(bench/RESULTS.md, "M3.2 hostile tenant: one OpenMP team per server process").
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def settle_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None,
                      result: Any = None) -> None:
    """Complete `future` (of `loop`) from another thread; one cancelled meanwhile is left alone."""

    def done() -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    loop.call_soon_threadsafe(done)


async def run_in_short_lived_thread(work: Callable[[], T], name: str = "ferrylm-torch-work") -> T:
    """`work()` on a new thread that exits when it returns; its result or exception here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = work()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
            settle_threadsafe(loop, done, e)
        else:
            settle_threadsafe(loop, done, None, result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
