"""Process entry points for the shared-limit test (importable without pytest, for spawn)."""

from __future__ import annotations

from ferrylm.gateway import Gateway, GatewayConfig
from ferrylm.http.errors import APIError

FROZEN_NOW = 1_750_000_000.0


def admit_many(state_db: str, redis_url: str, prefix: str, key: str, attempts: int, barrier, results) -> None:
    """One gateway replica: try `attempts` admissions (10 prompt + 50 max tokens), report back.
    The clock is frozen so no refill happens: the bucket is the whole allowance."""
    config = GatewayConfig(require_auth=True, state_db=state_db, redis_url=redis_url, redis_key_prefix=prefix)
    gateway = Gateway(config, clock=lambda: FROZEN_NOW)
    headers = {"authorization": f"Bearer {key}"}
    barrier.wait()
    admitted, statuses = 0, []
    for _ in range(attempts):
        try:
            gateway.admit_sync(headers, "10.0.0.1", "m", 10, 50, None)
            admitted += 1
        except APIError as e:
            statuses.append(e.status)
    results.put((admitted, statuses))
    gateway.close()
