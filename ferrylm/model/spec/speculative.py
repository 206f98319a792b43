"""Speculative decoding's two halves that do not depend on the scheduler: a Proposer that guesses the
next K tokens, and the verification that keeps the output exactly what the target model would give.

- NgramProposer (prompt lookup): the last n tokens (prompt_lookup_max down to prompt_lookup_min)
  matched earlier in the request's own prompt + output; the tokens that followed are the proposal.
- verify_greedy: the longest prefix of the proposal equal to the target's argmax, plus the target's
  own next token (output identical to non-speculative greedy decoding).
- rejection_sample (Leviathan et al. 2023, Chen et al. 2023): draft token x_i is kept with
  probability min(1, p(x_i) / q(x_i)); at the first rejection the token is drawn from the residual
  max(0, p - q) renormalised, and if all K are kept a bonus token is drawn from p. The emitted tokens
  are then distributed exactly as the target's own samples. p and q are the processed distributions
  (penalties, logit_bias, temperature, top-k/p, min-p already applied to both). A proposer without
  a distribution (n-gram) is a one-hot q.

The runner proposes after each step (runner.py), the scheduler schedules the draft within the
token budget and gives back the slots of rejected tokens (scheduler.py, block_manager.trim).
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import torch


class NgramProposer:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the context's tail."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k tokens (empty when no n-gram of the tail occurs earlier). Longest n first, then the
        latest occurrence: the nearest context is the best guess of what repeats. The search is a
        bytes.rfind over the ids packed 4 bytes each (C speed: called per request per step)."""
        total = len(token_ids)
        if total < 2:
            return []
        data = array("I", token_ids).tobytes()
        end = (total - 1) * 4  # an occurrence must end before the tail does
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            tail = data[(total - n) * 4:]
            limit = end
            while True:
                at = data.rfind(tail, 0, limit)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4
                    return token_ids[start + n:start + n + self.k]
                limit = at + len(tail) - 1  # misaligned: look further left
        return []


class DraftBackoff:
    """Per request: stop proposing for a while when most drafts are rejected (open-ended text),
    so verification's extra tokens are not paid for nothing; probe again after the pause."""

    WINDOW = 16  # draft tokens judged at once
    MIN_RATE = 0.25  # acceptance below this pauses proposals
    PAUSE = 16  # steps without proposals

    def __init__(self) -> None:
        self.drafted = self.accepted = self.paused = 0

    def allows(self) -> bool:
        if self.paused:
            self.paused -= 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted >= self.WINDOW:
            if self.accepted < self.MIN_RATE * self.drafted:
                self.paused = self.PAUSE
            self.drafted = self.accepted = 0


class Verified(NamedTuple):
    """Per row: the tokens to emit (the accepted draft prefix, then one target token)."""

    tokens: list[list[int]]
    num_accepted: list[int]  # draft tokens kept per row (len(tokens[i]) - 1)


def verify_greedy(target_logits: torch.Tensor, draft: list[list[int]]) -> Verified:
    """`target_logits` [N, K+1, V] at the positions after each draft token (row i uses its first
    len(draft[i]) + 1); the accepted prefix is where the draft equals the argmax."""
    best = target_logits.argmax(dim=-1).tolist()
    tokens, accepted = [], []
    for row, proposal in zip(best, draft):
        n = 0
        while n < len(proposal) and proposal[n] == row[n]:
            n += 1
        tokens.append(proposal[:n] + [row[n]])
        accepted.append(n)
    return Verified(tokens, accepted)


def rejection_sample(target_probs: torch.Tensor, draft: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> Verified:
    """Distribution-exact verification of K draft tokens per row, batched.

    target_probs [N, K+1, V]: the target's processed distribution after each draft prefix (position K:
    after the whole draft, for the bonus token). draft [N, K] int64. draft_probs [N, K, V] (the
    proposer's q), or None for a deterministic proposer (q one-hot on the draft token).
    """
    n_rows, k = draft.shape
    p_all = target_probs.float()
    p_draft = p_all[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [N, K]
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs.float().gather(-1, draft.unsqueeze(-1)).squeeze(-1)
        ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-30), torch.ones_like(p_draft))
    u = torch.rand(n_rows, k, generator=generator, device=draft.device)
    kept = u < ratio.clamp(max=1.0)
    num_accepted = torch.cumprod(kept.int(), dim=1).sum(dim=1)  # [N]: leading run of accepts
    rows = torch.arange(n_rows, device=draft.device)
    # The last token's distribution: the residual at the first rejection, else p after the whole draft.
    p_next = p_all[rows, num_accepted]  # [N, V]
    rejected = num_accepted < k
    if bool(rejected.any()):
        pos = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, draft[rows, pos].unsqueeze(1), 1.0)
        else:
            q_next = draft_probs.float()[rows, pos]
        residual = (p_next - q_next).clamp_min(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # p == q: any p-draw
        p_next = torch.where(rejected.unsqueeze(1), residual, p_next)
    last = torch.multinomial(p_next, 1, generator=generator).squeeze(1)
    accepted = num_accepted.tolist()
    draft_rows, last_tokens = draft.tolist(), last.tolist()
    tokens = [draft_rows[i][:accepted[i]] + [last_tokens[i]] for i in range(n_rows)]
    return Verified(tokens, accepted)
