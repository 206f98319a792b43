"""ServerState: the engine (once loaded), metrics, readiness and drain state of one app."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.engine import Engine
from ferrylm.engine.short_lived_thread import run_in_short_lived_thread
from ferrylm.http.drain import DrainController
from ferrylm.http.errors import APIError, engine_dead, model_not_found
from ferrylm.load_report import LoadReport
from ferrylm.observability.dashboard.readings import server_reader
from ferrylm.observability.dashboard.sampler import DashboardSampler, Health
from ferrylm.observability.metrics import ServerMetrics
from ferrylm.observability.tracing import Tracing
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.config import ServerConfig
from ferrylm.server.health import ReadinessProbe, liveness

log = logging.getLogger("ferrylm.server")
WARMUP_TIMEOUT_S = 300.0


class ServerState:
    """Loads the engine in the background (the server answers /health and 503s meanwhile)."""

    def __init__(self, config: ServerConfig, engine_factory: Callable[[], Engine], span_exporter: Any = None):
        self.config = config
        self._engine_factory = engine_factory
        self.engine: AsyncEngine | None = None
        self.probe: ReadinessProbe | None = None
        self.ready = False  # loaded and warmed up
        self.load_error: BaseException | None = None
        self.fatal = asyncio.Event()  # set when the server cannot work and should exit
        self.drain = DrainController()
        self.metrics = ServerMetrics(config.model_name, self._stats, config.tenant_metrics,
                                     config.tensor_parallel_size)
        self.tracing = Tracing.create(config.tracing, span_exporter)  # None: tracing off
        self.dashboard = DashboardSampler(server_reader(self._stats, self.metrics.registry, self.health_now), "serve")
        self._load_task: asyncio.Task | None = None
        self.gateway = None
        if config.gateway is not None:
            from ferrylm.gateway.policy import Gateway
            from ferrylm.observability.metrics import RATE_LIMITER_FAILURES, ReadCounter

            gateway = self.gateway = Gateway(config.gateway)
            self.metrics.registry.register(ReadCounter(*RATE_LIMITER_FAILURES, lambda: gateway.limiter_failures))

    def _stats(self) -> LoadReport | None:
        return self.engine.stats() if self.engine is not None else None

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        self._load_task = asyncio.create_task(self._load())
        self.dashboard.start()
        try:
            yield
        finally:
            self._load_task.cancel()
            await self.dashboard.stop()
            if self.engine is not None:
                await asyncio.to_thread(self.engine.shutdown)
            if self.gateway is not None:
                self.gateway.close()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans still queued

    async def _load(self) -> None:
        start = time.monotonic()
        try:
            # not asyncio.to_thread: its worker would keep an OpenMP pool that slows every decode step
            engine = await run_in_short_lived_thread(self._engine_factory, name="ferrylm-load")
            self.engine = async_engine = AsyncEngine(engine)
            async_engine.start()
            for name, path in self.config.lora_modules:  # --lora-modules: a bad adapter fails the start
                await async_engine.load_lora(name, path)
            self.probe = ReadinessProbe(async_engine, engine.tokenizer.encode("ok"), self.config.ready_timeout_s)
            await self._warm_up(async_engine, engine)
            freeze_startup_heap()
        except Exception as e:  # noqa: BLE001 - a server that cannot load must say why and exit
            log.exception("engine failed to load")
            self.load_error = e
            self.fatal.set()
            return
        self.ready = True
        log.info("engine ready", extra={"seconds": round(time.monotonic() - start, 2),
                                        "max_model_len": engine.max_model_len,
                                        "kv_blocks": engine.stats().kv_blocks_total})

    async def _warm_up(self, async_engine: AsyncEngine, engine: Engine) -> None:
        """One short chat generation through the whole path, so the first user pays no one-off costs."""
        tok = engine.tokenizer
        await asyncio.to_thread(lambda: tok.max_token_chars)  # computed once, off the event loop
        prompt = (tok.apply_chat_template([{"role": "user", "content": "Hello"}]) if tok.has_chat_template
                  else tok.encode("Hello"))
        stream = await async_engine.add_request("warmup", prompt, SamplingParams(temperature=0.0, max_tokens=4))
        try:
            async with asyncio.timeout(WARMUP_TIMEOUT_S):
                async for _ in stream:
                    pass
        finally:
            await stream.aclose()

    def health_now(self) -> Health:
        """Liveness and readiness as the dashboard shows them (from state; /ready's probe request is not sent)."""
        live = liveness(self.engine, self.config.heartbeat_timeout_s)
        state = ("draining" if self.drain.draining else f"load failed: {self.load_error}" if self.load_error
                 else "loading" if not self.ready else live.reason)
        return Health("this server", state, state == "ok", {"live": live.ok, "ready": state == "ok",
                                                            "model": self.config.model_name})

    def admit(self) -> AsyncEngine:
        """The engine for a new request, or a 503 while loading, draining or dead."""
        self.drain.check_admitting()
        if self.load_error is not None:
            raise APIError(503, f"The model failed to load: {self.load_error}", code="model_load_failed")
        if self.engine is None or not self.ready:
            raise APIError(503, "The model is still loading; retry shortly.", code="model_loading")
        if not self.engine.is_running:
            raise engine_dead()
        return self.engine

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; 404 model_not_found for a model this server does not serve (a
        served name, or a loaded LoRA adapter's)."""
        if requested is None:
            return self.config.model_name
        if requested not in self.config.served_model_names and self.adapter_of(requested) is None:
            raise model_not_found(requested)
        return requested

    def adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a request for `model` runs through (None: the base model)."""
        if model in self.config.served_model_names or self.engine is None or not self.config.enable_lora:
            return None
        return model if any(a.name == model for a in self.engine.lora_adapters()) else None


def freeze_startup_heap() -> None:
    """Put every object alive once the engine is up (torch modules, the tokenizer's vocabulary,
    transformers' and FastAPI's own: ~286k tracked objects with the default model) out of the cyclic
    GC's reach (gc.freeze). A full collection walks only what was allocated since: 143 ms with the
    GIL held, stopping the engine thread and the event loop, before; ~0 ms after (bench/RESULTS.md)."""
    gc.collect()
    gc.freeze()
