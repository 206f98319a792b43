"""One upstream replica as the router sees it: readiness from polling, a circuit breaker from
live traffic, and the load the router itself has put on it (outstanding tokens, TTFT EWMA)."""

from __future__ import annotations

import threading

from ferrylm.load_report import LoadReport
from ferrylm.router.breaker import BreakerState, CircuitBreaker


class Ticket:
    """One request's share of a replica's outstanding tokens: prompt tokens until the first token
    arrives (prefill done), then the expected output still to decode."""

    def __init__(self, replica: "Replica", prompt_tokens: int, expected_output: int):
        self.replica = replica
        self.prefill = max(0, prompt_tokens)
        self.decode = max(0, expected_output)
        self.closed = False

    def first_token(self) -> None:
        self.replica._adjust(self, prefill=0, decode=self.decode)

    def generated(self, n: int) -> None:
        self.replica._adjust(self, prefill=self.prefill, decode=max(0, self.decode - n))

    def close(self) -> None:
        self.replica._close(self)


class Replica:
    """Thread-safe state of one upstream URL within one model group."""

    def __init__(self, url: str, group: str, breaker: CircuitBreaker, ewma_alpha: float = 0.2):
        self.url = url
        self.group = group
        self.breaker = breaker
        self.ready = False  # from the poller: /ready answered 200
        self.ever_ready = False
        self.poll_failures = 0  # consecutive failed readiness polls
        self.load: LoadReport | None = None  # the replica's last readable /load answer
        self.served_model: str | None = None  # the upstream's own model name, from /load
        self.block_size: int | None = None
        self.max_model_len: int | None = None  # the replica's context window, from /load
        self.ttft_ewma_s: float | None = None
        self._alpha = ewma_alpha
        self._lock = threading.Lock()
        self._tickets: set[Ticket] = set()
        self._outstanding = 0

    def __repr__(self) -> str:
        return f"Replica({self.url}, ready={self.ready}, breaker={self.breaker.state.name})"

    def available(self, now: float) -> bool:
        """Ready by the last poll and not ejected (a cooled-down breaker offers its probe)."""
        return self.ready and self.breaker.available(now)

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters its last /load reported loaded."""
        return self.load.lora_adapters if self.load is not None else []

    @property
    def outstanding_tokens(self) -> int:
        return self._outstanding

    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    @property
    def ejected(self) -> bool:
        return self.breaker.state is not BreakerState.CLOSED

    def begin(self, prompt_tokens: int, expected_output: int) -> Ticket:
        ticket = Ticket(self, prompt_tokens, expected_output)
        with self._lock:
            self._tickets.add(ticket)
            self._outstanding += ticket.prefill + ticket.decode
        return ticket

    def _adjust(self, ticket: Ticket, prefill: int, decode: int) -> None:
        with self._lock:
            if ticket.closed:
                return
            self._outstanding += (prefill + decode) - (ticket.prefill + ticket.decode)
            ticket.prefill, ticket.decode = prefill, decode

    def _close(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.closed:
                return
            ticket.closed = True
            self._tickets.discard(ticket)
            self._outstanding -= ticket.prefill + ticket.decode

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            prev = self.ttft_ewma_s
            self.ttft_ewma_s = seconds if prev is None else prev + self._alpha * (seconds - prev)

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(t.prefill + t.decode for t in self._tickets)
            if total != self._outstanding or self._outstanding < 0:
                raise AssertionError(f"{self.url}: outstanding {self._outstanding} != tickets {total}")
        self.breaker.check_invariants()
