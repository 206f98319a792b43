"""A fleet-wide retry budget (as Finagle and Envoy have): every request deposits a fraction of a
retry, every retry spends one, so retries can add at most `ratio` of the traffic on top of a small
reserve. When the fleet is saturated, retries stop instead of multiplying the load."""

from __future__ import annotations

import threading


class RetryBudget:
    def __init__(self, ratio: float, reserve: float):
        self.ratio = ratio
        self.reserve = reserve
        self._balance = reserve
        self._cap = max(reserve, 10.0)
        self.spent = 0
        self.denied = 0
        self._lock = threading.Lock()

    def deposit(self) -> None:
        """A new request arrived."""
        with self._lock:
            self._balance = min(self._cap + self.ratio * 100, self._balance + self.ratio)

    def try_spend(self) -> bool:
        """May this request retry? Spends one retry if so."""
        with self._lock:
            if self._balance >= 1.0:
                self._balance -= 1.0
                self.spent += 1
                return True
            self.denied += 1
            return False

    @property
    def balance(self) -> float:
        return self._balance

    def check_invariants(self) -> None:
        if self._balance < 0:
            raise AssertionError(f"negative retry balance {self._balance}")
