"""Liveness (/health: is the engine loop alive?) and readiness (/ready: can it serve a token now?)."""

from __future__ import annotations

import asyncio
import itertools
from typing import NamedTuple

from ferrylm.engine.client import EngineClient, EngineDeadError
from ferrylm.sampling_params import SamplingParams

# Probes go ahead of every queued request: readiness asks whether the engine works, not how busy it is.
PROBE_PRIORITY = -(2 ** 31)


class Verdict(NamedTuple):
    ok: bool
    reason: str


def liveness(engine: EngineClient | None, heartbeat_timeout_s: float) -> Verdict:
    """Alive while loading and while the loop's heartbeat is fresh; dead if the loop crashed or hangs."""
    if engine is None:
        return Verdict(True, "loading")
    if not engine.is_running:
        return Verdict(False, f"engine loop stopped: {engine.error!r}")
    age = engine.seconds_since_heartbeat()
    if age > heartbeat_timeout_s:
        return Verdict(False, f"engine loop silent for {age:.1f}s")
    return Verdict(True, "ok")


class ReadinessProbe:
    """Runs a real one-token greedy generation through the scheduler, with a timeout.

    Concurrent /ready calls share one probe in flight, so a burst of checks costs one request.
    """

    def __init__(self, engine: EngineClient, prompt_ids: list[int], timeout_s: float):
        self._engine = engine
        self._prompt_ids = prompt_ids
        self._timeout_s = timeout_s
        self._ids = itertools.count()
        self._inflight: asyncio.Future[Verdict] | None = None

    async def check(self) -> Verdict:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._inflight)

    async def _probe(self) -> Verdict:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        stream = None
        try:
            async with asyncio.timeout(self._timeout_s):
                stream = await self._engine.add_request(f"ready-{next(self._ids)}", self._prompt_ids, params,
                                                        PROBE_PRIORITY)
                async for out in stream:
                    if out.finished:
                        return Verdict(True, "ok")
            return Verdict(False, "probe ended without output")
        except TimeoutError:
            return Verdict(False, f"no token within {self._timeout_s}s")
        except EngineDeadError as e:
            return Verdict(False, str(e))
        finally:
            if stream is not None:
                await stream.aclose()
