"""What a step costs, learned from the steps the engine ran: seconds ≈ fixed + per_token × tokens,
a least-squares line over a sliding window. The scheduler asks it how many prefill tokens fit into
a step's headroom (--decode-isolation-headroom). On a compute-bound CPU a prompt token costs about
what a decode row does (~2 ms beside a 17 ms 4-decode step for SmolLM2 on 2 AVX2 cores,
bench/mixed_step.py); on a memory-bound GPU it costs a small fraction, and many more fit."""

from __future__ import annotations

from collections import deque

WINDOW = 256  # steps remembered: a few seconds of traffic on a CPU


class StepCostModel:
    def __init__(self, window: int = WINDOW):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, seconds))

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before any step. While the window holds one
        token count only, the fixed part cannot be told apart: every second is charged to the tokens
        (a cost per token too high, so the allowance errs small)."""
        if not self._steps:
            return None
        n = len(self._steps)
        mean_t = sum(t for t, _ in self._steps) / n
        mean_s = sum(s for _, s in self._steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._steps)
        if var < 1e-9:
            return 0.0, mean_s / mean_t
        slope = sum((t - mean_t) * (s - mean_s) for t, s in self._steps) / var
        if slope <= 0:  # noise (or steps whose cost is not in their tokens): proportional, as above
            return 0.0, mean_s / mean_t
        return max(0.0, mean_s - slope * mean_t), slope

    def prefill_allowance(self, headroom: float, decode_tokens: int) -> int:
        """Prompt tokens that lengthen a step of `decode_tokens` decode rows by at most `headroom` of
        its time (at least 1: a prompt always progresses)."""
        fitted = self.line()
        if fitted is None:
            return 1
        fixed, per_token = fitted
        step = fixed + per_token * decode_tokens
        return max(1, int(headroom * step / per_token))
