"""Policy in front of the engine: auth, rate limits, quotas, admission control, audit.

The server's seam is `Gateway.admit` / `Gateway.finish` (policy.py); the CLI's is
`add_gateway_commands` (cli.py). Refusals are http.errors.APIError. Importing this package does
not import FastAPI or Redis.
"""

from ferrylm.gateway.config import AdmissionConfig, GatewayConfig, JWTConfig
from ferrylm.gateway.errors import AuthError, PermissionDenied
from ferrylm.gateway.policy import Admission, Gateway

__all__ = ["Admission", "AdmissionConfig", "AuthError", "Gateway", "GatewayConfig", "JWTConfig", "PermissionDenied"]
