"""What a proxied request settles when it ends, however it ends: its observation (span, per-tenant
e2e) and the gateway admission (limits, quota, audit) with the usage the replica reported. Run
through http/settlement.py's Settlement, so it happens exactly once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferrylm.gateway.policy import Admission, Gateway
from ferrylm.router.observation import GatewayObservation


@dataclass
class ProxiedRequestEnd:
    """The settlement callback of one proxied request: (status, prompt tokens or None when the
    replica reported none, completion tokens, cached prompt tokens)."""

    gateway: Gateway | None
    admission: Admission | None
    billed_prompt_tokens: int  # each prompt once: what the request costs if the replica reports no usage
    observation: GatewayObservation
    started: float = field(default_factory=time.monotonic)

    def _unreported_prompt(self, status: int) -> int:
        """Prompt tokens to bill when the replica reported no usage: none for a request it refused
        (4xx, as `ferrylm serve` bills a refused request), each prompt once otherwise."""
        return 0 if 400 <= status < 499 else self.billed_prompt_tokens

    async def __call__(self, status: int, prompt: int | None, completion: int, cached: int = 0) -> None:
        self.observation.end(status, prompt, completion)
        if self.admission is not None and self.gateway is not None:
            await self.gateway.finish(self.admission, status,
                                      prompt if prompt is not None else self._unreported_prompt(status),
                                      completion, time.monotonic() - self.started,
                                      cached_tokens=cached if isinstance(cached, int) else 0)
