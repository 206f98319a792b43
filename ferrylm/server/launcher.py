"""Run the app under uvicorn: bind, log where we listen, drain on SIGTERM, exit 0 when drained."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from ferrylm.engine.engine import Engine
from ferrylm.observability.log import configure_logging
from ferrylm.server.app import build_app
from ferrylm.server.config import ServerConfig
from ferrylm.server.state import ServerState

log = logging.getLogger("ferrylm.server")
# Longer than httpx's (and so the openai SDK's) 5 s pool expiry: a client never reuses a
# keep-alive connection at the instant the server closes it.
KEEP_ALIVE_S = 15


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful first signal: drain (503 to new requests, finish in-flight
    ones up to a deadline), then stop. A second signal stops at once.

    uvicorn's own handler would close the listening socket (refusing, not 503ing, new clients) and
    re-raise SIGTERM after shutdown, so the exit status would not be 0.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._background: set[asyncio.Task] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._exit_on_fatal())
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._spawn, self._drain_then_exit(sig))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drain_then_exit(self, sig: int) -> None:
        log.info("signal received; draining", extra={"signal": sig})
        await self._state.drain.drain(self._state.config.drain_timeout_s)
        self.should_exit = True

    async def _exit_on_fatal(self) -> None:
        await self._state.fatal.wait()
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so the startup line can name the real port (also for --port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run_server(config: ServerConfig, engine_factory: Callable[[], Engine]) -> int:
    """Serve until drained or stopped; 0 on a clean shutdown, 1 if the model failed to load."""
    configure_logging(config.log_level)
    sock = bind_socket(config.host, config.port)
    app = build_app(config, engine_factory)
    state: ServerState = app.state.ferry
    uv_config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                               timeout_graceful_shutdown=5, log_level=config.log_level,
                               timeout_keep_alive=KEEP_ALIVE_S)
    server = DrainingServer(uv_config, state)
    host, port = sock.getsockname()[:2]
    log.info("listening", extra={"url": f"http://{host}:{port}", "host": host, "port": port,
                                 "model": config.model_name})
    asyncio.run(server.serve(sockets=[sock]))
    if state.load_error is not None:
        print(f"ferrylm: could not load the model: {state.load_error}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
