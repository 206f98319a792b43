"""Shared test helpers: a clock that moves only when told, and admit-with-a-key."""

from __future__ import annotations

from ferrylm.gateway import Admission, Gateway

T0 = 1_750_000_000.0  # a fixed epoch second (2025-06-15, mid-day UTC)


class FakeClock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, start: float = T0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def admit(gw: Gateway, key: str, model: str = "m", prompt_tokens: int = 10, max_tokens: int = 100,
          stats=None, client: str = "127.0.0.1") -> Admission:
    """admit_sync with a bearer key; invariants checked after."""
    try:
        return gw.admit_sync(bearer(key), client, model, prompt_tokens, max_tokens, stats)
    finally:
        gw.check_invariants()
