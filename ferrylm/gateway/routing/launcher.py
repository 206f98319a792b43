"""Run the standalone gateway under uvicorn with the server's drain-on-SIGTERM behaviour."""

from __future__ import annotations

import asyncio
import logging

from ferrylm.gateway.routing.app import build_gateway_app
from ferrylm.gateway.routing.config import GatewayServerConfig
from ferrylm.observability.log import configure_logging
from ferrylm.server.launcher import DrainingServer, bind_socket, uvicorn_config

log = logging.getLogger("ferrylm.gateway")


def run_gateway(config: GatewayServerConfig) -> int:
    configure_logging(config.log_level)
    sock = bind_socket(config.host, config.port)
    app = build_gateway_app(config)
    server = DrainingServer(uvicorn_config(app, config.connections, config.log_level), app.state.ferry)
    host, port = sock.getsockname()[:2]
    log.info("listening", extra={"url": f"http://{host}:{port}", "host": host, "port": port,
                                 "models": [g.name for g in config.router.groups],
                                 "upstreams": [u for g in config.router.groups for u in g.upstreams]})
    asyncio.run(server.serve(sockets=[sock]))
    log.info("stopped")
    return 0
