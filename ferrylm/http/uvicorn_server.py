"""The draining uvicorn server both front ends run under: drain on SIGTERM and exit 0 when
drained; bound idle and slow connections (keep-alive and request-head timeouts, a connection cap)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrylm.http.config import ConnectionLimits
from ferrylm.http.drain import DrainController
from ferrylm.http.errors import APIError

log = logging.getLogger("ferrylm.http")
_OVER_CAP_BODY = json.dumps(APIError(503, "The server has too many open connections; retry shortly.",
                                     code="too_many_connections").body()).encode()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus what it lacks against idle and slow clients.

    A request-head deadline: uvicorn's keep-alive timer runs only between requests and the first
    byte of the next one cancels it, so a client that connects and never sends, or sends a header
    byte every few seconds (slowloris), holds its connection forever. Here a request head must be
    complete `timeout_headers_s` after the connection opened (first request) or after its first
    byte (later ones), else the connection is closed unanswered, as nginx and Go's net/http do.

    The connection cap in OpenAI's error shape: beyond `limit_concurrency` open connections or
    requests in flight a request gets a JSON 503 (uvicorn's own is plain text) and is closed.
    """

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._inner_app = self.app
        self.app = self._capped_app
        self.limit_concurrency = None  # uvicorn's own check (plain-text 503) is replaced by _capped_app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # the first byte of a later request on a keep-alive connection
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a whole request head arrived
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self._limits.timeout_headers_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug("request head not complete in time; connection closed", extra={"client": self.client})
            self.transport.close()

    async def _capped_app(self, scope, receive, send) -> None:
        cap = self._limits.limit_concurrency
        if len(self.connections) <= cap and len(self.tasks) <= cap:  # both count this one
            await self._inner_app(scope, receive, send)
            return
        log.warning("connection limit reached; 503", extra={"connections": len(self.connections),
                                                             "in_flight": len(self.tasks), "limit": cap})
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(_OVER_CAP_BODY)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": _OVER_CAP_BODY})


def uvicorn_config(app, limits: ConnectionLimits, log_level: str) -> uvicorn.Config:
    """uvicorn's settings for `ferrylm serve` and `ferrylm gateway`: our logging and lifespan, the
    keep-alive timeout, and the h11 protocol bounded by `limits`."""
    return uvicorn.Config(app, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=5,
                          log_level=log_level, timeout_keep_alive=limits.timeout_keep_alive_s,  # type: ignore[arg-type]
                          http=functools.partial(BoundedH11Protocol, limits=limits))  # type: ignore[arg-type]


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful first signal: drain (503 to new requests, finish in-flight
    ones up to a deadline), then stop. A second signal stops at once.

    uvicorn's own handler would close the listening socket (refusing, not 503ing, new clients) and
    re-raise SIGTERM after shutdown, so the exit status would not be 0.
    """

    def __init__(self, config: uvicorn.Config, drain: DrainController, drain_timeout_s: float,
                 fatal: asyncio.Event):
        super().__init__(config)
        self._drain, self._drain_timeout_s, self._fatal = drain, drain_timeout_s, fatal
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
        await self._drain.drain(self._drain_timeout_s)
        self.should_exit = True

    async def _exit_on_fatal(self) -> None:
        await self._fatal.wait()
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
