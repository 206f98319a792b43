"""Run the standalone gateway under uvicorn with the server's drain-on-SIGTERM behaviour."""

from __future__ import annotations

import asyncio
import logging

from ferrylm.http.uvicorn_server import DrainingServer, bind_socket, uvicorn_config
from ferrylm.observability.log import configure_logging
from ferrylm.router.app import build_gateway_app
from ferrylm.router.config import GatewayServerConfig

log = logging.getLogger("ferrylm.gateway")


def run_gateway(config: GatewayServerConfig) -> int:
    configure_logging(config.log_level)
    sock = bind_socket(config.host, config.port)
    app = build_gateway_app(config)
    state = app.state.ferry
    server = DrainingServer(uvicorn_config(app, config.connections, config.log_level), state.drain,
                            config.drain_timeout_s, state.fatal)
    host, port = sock.getsockname()[:2]
    log.info("listening", extra={"url": f"http://{host}:{port}", "host": host, "port": port,
                                 "models": [g.name for g in config.router.groups],
                                 "upstreams": [u for g in config.router.groups for u in g.upstreams]})
    asyncio.run(server.serve(sockets=[sock]))
    log.info("stopped")
    return 0
