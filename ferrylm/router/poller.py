"""Active health checks: poll every replica's /ready and /load. A refused connection or a
draining replica leaves rotation at once; a slow or failed probe only after `poll_failures`
polls in a row, because /ready runs a real token through a busy replica's engine and a fleet
under load must not look dead. A replica whose breaker has cooled down and that polls ready again
is closed (the half-open probe), so a restarted replica comes back without live traffic."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from ferrylm.load_report import LoadReport
from ferrylm.router.breaker import BreakerState
from ferrylm.router.config import RouterConfig
from ferrylm.router.registry import ReplicaRegistry
from ferrylm.router.replica import Replica

log = logging.getLogger("ferrylm.router")


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class HealthPoller:
    def __init__(self, registry: ReplicaRegistry, config: RouterConfig, client: httpx.AsyncClient):
        self.registry, self.config, self.client = registry, config, client
        # A replica with --metrics-require-auth answers /load only with a credential.
        key = config.upstream_api_key
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """One loop per replica, so a slow replica never delays noticing another one's death."""
        self._tasks = [asyncio.create_task(self._run(r)) for r in self.registry.replicas()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll_safely(r) for r in self.registry.replicas()))

    async def _run(self, replica: Replica) -> None:
        while True:
            await self._poll_safely(replica)
            await asyncio.sleep(self.config.poll_interval_s)

    async def _poll_safely(self, replica: Replica) -> None:
        """A reply the poller cannot read (an HTML error page, odd JSON) counts as a failed poll."""
        try:
            await self._poll(replica)
        except Exception:  # noqa: BLE001 - never let one bad answer stop health checking
            log.warning("unreadable health answer", extra={"replica": replica.url}, exc_info=True)
            replica.poll_failures += 1
            if replica.poll_failures >= self.config.poll_failures:
                replica.ready = False

    async def _ready(self, replica: Replica) -> tuple[bool, bool]:
        """(ready, down at once): refused or draining is decisive, a slow or failed probe is not."""
        try:
            r = await self.client.get(replica.url + "/ready", timeout=self.config.poll_timeout_s)
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            return False, True
        except httpx.HTTPError:
            return False, False
        if r.status_code == 200:
            return True, False
        try:
            status = str(r.json().get("status", ""))
        except (ValueError, AttributeError):
            status = ""
        return False, status == "draining" or status.startswith(("load failed", "engine loop"))

    async def _poll(self, replica: Replica) -> None:
        ok, decisive = await self._ready(replica)
        replica.poll_failures = 0 if ok else replica.poll_failures + 1
        ready = ok or (replica.ready and not decisive and replica.poll_failures < self.config.poll_failures)
        load = None
        if ok:
            try:
                load = await self.client.get(replica.url + "/load", timeout=self.config.poll_timeout_s,
                                             headers=self._auth)
            except httpx.HTTPError:
                pass
        if load is not None and load.status_code == 200:
            body = load.json()
            replica.load = LoadReport.from_json(body)  # ValueError if a field is missing: unreadable
            replica.block_size = body.get("block_size") or replica.block_size
            replica.max_model_len = _positive_int(body.get("max_model_len")) or replica.max_model_len
            models = body.get("models") or []
            replica.served_model = models[0] if models else replica.served_model
        if ready != replica.ready:
            log.info("replica ready" if ready else "replica not ready", extra={"replica": replica.url})
        replica.ready = ready
        replica.ever_ready |= ready
        breaker = replica.breaker
        if ready and breaker.state is not BreakerState.CLOSED and breaker.available(time.monotonic()):
            breaker.record_success()
            log.info("replica back in rotation", extra={"replica": replica.url})
