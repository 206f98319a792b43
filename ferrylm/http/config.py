"""ConnectionLimits: the HTTP layer's one config object, shared by both front ends."""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.config import ConfigError


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client connection may sit idle or dribble a request head, and how many may be
    open at once (`ferrylm serve` and `ferrylm gateway` alike; flags named after uvicorn's)."""

    # Longer than httpx's (and so the openai SDK's) 5 s pool expiry: a client never reuses a
    # keep-alive connection at the instant the server closes it.
    timeout_keep_alive_s: float = 15.0  # idle between requests on a keep-alive connection
    timeout_headers_s: float = 10.0  # a request head must be complete this long after it began
    limit_concurrency: int = 1024  # open connections (and requests in flight); beyond: 503

    def __post_init__(self) -> None:
        if min(self.timeout_keep_alive_s, self.timeout_headers_s) <= 0:
            raise ConfigError("connection timeouts must be positive")
        if self.limit_concurrency < 1:
            raise ConfigError("limit_concurrency must be at least 1")
