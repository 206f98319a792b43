"""`ferrylm serve`: bind, build the app, log where we listen, run under the draining uvicorn server."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from ferrylm.engine.engine import Engine
from ferrylm.http.uvicorn_server import DrainingServer, bind_socket, uvicorn_config
from ferrylm.observability.log import configure_logging
from ferrylm.server.app import build_app
from ferrylm.server.config import ServerConfig
from ferrylm.server.state import ServerState

log = logging.getLogger("ferrylm.server")


def run_server(config: ServerConfig, engine_factory: Callable[[], Engine]) -> int:
    """Serve until drained or stopped; 0 on a clean shutdown, 1 if the model failed to load."""
    configure_logging(config.log_level)
    sock = bind_socket(config.host, config.port)
    app = build_app(config, engine_factory)
    state: ServerState = app.state.ferry
    server = DrainingServer(uvicorn_config(app, config.connections, config.log_level), state.drain,
                            config.drain_timeout_s, state.fatal)
    host, port = sock.getsockname()[:2]
    log.info("listening", extra={"url": f"http://{host}:{port}", "host": host, "port": port,
                                 "model": config.model_name})
    asyncio.run(server.serve(sockets=[sock]))
    if state.load_error is not None:
        print(f"ferrylm: could not load the model: {state.load_error}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
