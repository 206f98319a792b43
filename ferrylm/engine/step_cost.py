"""What a step costs, learned from the steps the engine ran: seconds ≈ fixed + per_token × tokens +
scored_extra × scored, a least-squares fit over a sliding window, where `scored` counts the prompt
tokens that also go through the LM head for prompt_logprobs (each then costs a vocabulary-wide
projection and log-softmax more than a plain prompt token: ~4.7 ms against ~3 ms for SmolLM2 in
float32 on 2 Zen 4 cores). The scheduler asks it for a step's headroom in seconds
(--decode-isolation-headroom) and what one prompt token of a kind costs. On a compute-bound CPU a
prompt token costs about what a decode row does (~2 ms beside a 17 ms 4-decode step for SmolLM2 on 2
AVX2 cores, bench/mixed_step.py); on a memory-bound GPU a small fraction, and many more fit."""

from __future__ import annotations

from collections import deque

WINDOW = 256  # steps remembered: a few seconds of traffic on a CPU
# a scored token's cost over a plain one's, until steps with scored tokens were seen: set high, so a
# tenant's scoring requests take too little headroom rather than too much
SCORED_PRIOR = 2.0


class StepCostModel:
    def __init__(self, window: int = WINDOW):
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)  # (tokens, scored, seconds)
        self._fitted: tuple[float, float, float] | None = None  # the window's fit, until the next step

    def observe(self, tokens: int, seconds: float, scored: int = 0) -> None:
        """A step of `tokens` tokens, `scored` of them prompt tokens scored for prompt_logprobs."""
        if tokens > 0 and seconds > 0:
            self._steps.append((tokens, min(max(scored, 0), tokens), seconds))
            self._fitted = None

    def token_seconds(self, scored: bool = False) -> float | None:
        """What one more prompt token costs (a scored one: plus its LM head and log-softmax)."""
        fit = self._fit()
        if fit is None:
            return None
        return fit[1] + (fit[2] if scored else 0.0)

    def _fit(self) -> tuple[float, float, float] | None:
        """(fixed, per_token, scored_extra) over the window."""
        if not self._steps:
            return None
        if self._fitted is None:
            self._fitted = self._fit_window()
        return self._fitted

    def _fit_window(self) -> tuple[float, float, float]:
        # the line from steps without scored tokens (from all, scored ones counted plain, if none is)
        plain = [(t, s) for t, k, s in self._steps if k == 0] or [(t, s) for t, _, s in self._steps]
        fixed, per_token = _line(plain)
        scored_steps = [(t, k, s) for t, k, s in self._steps if k > 0]
        if not scored_steps:
            return fixed, per_token, (SCORED_PRIOR - 1) * per_token
        # what scored steps took beyond the plain line, per scored token (never below zero)
        extra = sum(s - fixed - per_token * t for t, k, s in scored_steps) / sum(k for _, k, _ in scored_steps)
        return fixed, per_token, max(0.0, extra)

    def step_seconds(self, decode_tokens: int) -> float | None:
        """A step of `decode_tokens` decode rows and nothing else, as the fit predicts it (0 rows: its
        fixed part). While the window holds one token count only, the fixed part cannot be told apart:
        every second is charged to the tokens (a cost per token too high, so budgets err small)."""
        fit = self._fit()
        return None if fit is None else fit[0] + fit[1] * decode_tokens


def _line(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per_token) of seconds ≈ fixed + per_token × tokens; proportional when the tokens do
    not vary or the slope comes out non-positive (noise, or steps whose cost is not in their tokens)."""
    n = len(steps)
    mean_t = sum(t for t, _ in steps) / n
    mean_s = sum(s for _, s in steps) / n
    var = sum((t - mean_t) ** 2 for t, _ in steps)
    if var < 1e-9:  # observe() keeps only steps of at least one token: mean_t > 0
        return 0.0, mean_s / mean_t
    slope = sum((t - mean_t) * (s - mean_s) for t, s in steps) / var
    if slope <= 0:
        return 0.0, mean_s / mean_t
    return max(0.0, mean_s - slope * mean_t), slope
