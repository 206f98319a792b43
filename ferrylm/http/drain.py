"""Graceful shutdown: on SIGTERM stop admitting (503), let in-flight requests finish, then exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from ferrylm.http.errors import APIError

log = logging.getLogger("ferrylm.server")


class Abortable(Protocol):
    def abort(self) -> None: ...


class DrainController:
    """Tracks in-flight generations (Fanouts) and drains them before the process exits."""

    def __init__(self) -> None:
        self.draining = False
        self._active: set[Abortable] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another replica.", code="draining")

    def add(self, item: Abortable) -> None:
        self._active.add(item)
        self._idle.clear()

    def discard(self, item: Abortable) -> None:
        self._active.discard(item)
        if not self._active:
            self._idle.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new work and wait for in-flight work; past the deadline abort it. True if all finished."""
        self.draining = True
        start = time.monotonic()
        log.info("draining", extra={"in_flight": self.num_active, "timeout_s": timeout_s})
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            finished = True
        except TimeoutError:
            finished = False
            log.warning("drain deadline passed; aborting", extra={"in_flight": self.num_active})
            for item in list(self._active):
                item.abort()
            # Give the aborted streams a moment to send their finish_reason and [DONE].
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 2.0)
        log.info("drained", extra={"all_finished": finished, "seconds": round(time.monotonic() - start, 3)})
        return finished
