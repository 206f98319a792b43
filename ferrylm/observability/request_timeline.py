"""RequestTimeline: one API request's life in timestamps, gathered once from its sequences' final
outputs, so the `timings` response object, the trace's engine spans and their attributes all read
the same numbers (the engine only stamps times on the Request; it never calls a tracer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrylm.outputs import RequestOutput


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _per_token_ms(ms: float, n: int) -> float | None:
    return round(ms / n, 3) if n else None


def _per_second(ms: float, n: int) -> float | None:
    return round(n * 1000.0 / ms, 3) if n and ms > 0 else None


@dataclass(frozen=True)
class RequestTimeline:
    """time.monotonic() stamps over all of a request's sequences (n samples x prompts): the earliest
    arrival, first schedule and first token, the latest finish."""

    start: float  # the server received the request (before tokenizing)
    arrival: float  # the engine queued its first sequence
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    prefilled_tokens: int  # prompt tokens the engine computed (each sequence's, less its prefix-cache hits)
    cached_tokens: int  # prompt tokens served from the prefix cache
    completion_tokens: int
    detokenize_s: float  # time the engine spent detokenizing (summed over sequences)

    @classmethod
    def of(cls, start: float, finals: Sequence[RequestOutput]) -> RequestTimeline | None:
        """None when no sequence reached the engine (no metrics to read)."""
        metrics = [out.metrics for out in finals if out.metrics is not None]
        if not metrics:
            return None

        def earliest(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return min(present) if present else None

        finished = [m.finished_time for m in metrics if m.finished_time is not None]
        cached = sum(out.num_cached_tokens for out in finals)
        return cls(start=start, arrival=min(m.arrival_time for m in metrics),
                   first_scheduled=earliest([m.first_scheduled_time for m in metrics]),
                   first_token=earliest([m.first_token_time for m in metrics]),
                   finished=max(finished) if finished else None,
                   prefilled_tokens=max(sum(len(out.prompt_token_ids) for out in finals) - cached, 0),
                   cached_tokens=cached,
                   completion_tokens=sum(len(out.outputs[0].token_ids) for out in finals),
                   detokenize_s=sum(m.detokenize_time for m in metrics))

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else max(self.first_scheduled - self.arrival, 0.0)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else max(self.first_token - self.start, 0.0)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else max(self.finished - self.start, 0.0)

    def timings(self) -> dict[str, float | int | None]:
        """llama.cpp's `timings` object (prompt_* is the prefill: first schedule → first token, of
        the tokens not served from the prefix cache; predicted_* is the decode: first token → finish,
        of the tokens after the first), plus cache_n, queue_ms, ttft_ms and total_ms."""
        prompt_n = self.prefilled_tokens
        prompt_ms = _ms(self.first_token - self.first_scheduled) \
            if self.first_token is not None and self.first_scheduled is not None else 0.0
        predicted_n = max(self.completion_tokens - 1, 0) if self.first_token is not None else 0
        predicted_ms = _ms(self.finished - self.first_token) \
            if self.finished is not None and self.first_token is not None else 0.0
        return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": _per_token_ms(prompt_ms, prompt_n),
                "prompt_per_second": _per_second(prompt_ms, prompt_n), "predicted_n": predicted_n,
                "predicted_ms": predicted_ms, "predicted_per_token_ms": _per_token_ms(predicted_ms, predicted_n),
                "predicted_per_second": _per_second(predicted_ms, predicted_n), "cache_n": self.cached_tokens,
                "queue_ms": None if self.queue_s is None else _ms(self.queue_s),
                "ttft_ms": None if self.ttft_s is None else _ms(self.ttft_s),
                "total_ms": None if self.e2e_s is None else _ms(self.e2e_s)}
