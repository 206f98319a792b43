"""Speculative decoding's verification is distribution-exact and its greedy path is exact; the n-gram
proposer finds the latest, longest repeat. Chi-square tests over 60k draws on fixed distributions
(seeded: deterministic in CI), for a sampled draft model's q and for a one-hot (n-gram) q, with
temperature-1, top-k-like and top-p-like targets (zeros in p)."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import SpeculativeConfig
from ferrylm.model.spec.speculative import NgramProposer, rejection_sample, verify_greedy

DRAWS, V, K = 60_000, 8, 2


def chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `observed` counts under `probs` (cells with zero probability must be empty)."""
    assert observed[probs == 0].sum() == 0, "a token the target gives probability 0 was emitted"
    keep = probs > 0
    expected = probs[keep] * observed.sum()
    stat = ((observed[keep] - expected) ** 2 / expected).sum()
    df = torch.tensor(float(keep.sum() - 1))
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _target(kind: str, g: torch.Generator) -> torch.Tensor:
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    probs = torch.softmax(logits, dim=-1)
    if kind == "top_k":  # keep the 3 most likely, renormalised
        cut = probs.topk(3, dim=-1).values[:, -1:]
        probs = torch.where(probs >= cut, probs, torch.zeros_like(probs))
    elif kind == "top_p":  # smallest set with mass >= 0.7
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < 0.7
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep_sorted)
    return probs / probs.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("kind", ["temperature", "top_k", "top_p"])
@pytest.mark.parametrize("proposer", ["draft_model", "ngram"])
def test_rejection_sampling_matches_the_target_distribution(kind: str, proposer: str) -> None:
    g = torch.Generator().manual_seed(1234)
    p = _target(kind, g)
    target = p.expand(DRAWS, K + 1, V).contiguous()
    if proposer == "draft_model":
        q = torch.softmax(torch.randn(K, V, generator=g), dim=-1)
        draft = torch.multinomial(q, DRAWS, replacement=True, generator=g).T.contiguous()  # [DRAWS, K] ~ q
        draft_probs = q.expand(DRAWS, K, V).contiguous()
    else:  # a fixed proposal, as the n-gram proposer makes: q one-hot (half the time a token p bans)
        banned = int((p[0] == 0).nonzero()[0]) if bool((p[0] == 0).any()) else 0
        draft = torch.tensor([[banned, 1]] * (DRAWS // 2) + [[int(p[0].argmax()), 2]] * (DRAWS // 2))
        draft_probs = None
    out = rejection_sample(target, draft, draft_probs, generator=g)
    first = torch.tensor([t[0] for t in out.tokens])
    assert chi_square_p(torch.bincount(first, minlength=V).float(), p[0]) > 1e-3
    # where the first draft token was kept, the next emitted token follows p after it
    second = torch.tensor([t[1] for t, n in zip(out.tokens, out.num_accepted) if n >= 1])
    assert len(second) > 1000
    assert chi_square_p(torch.bincount(second, minlength=V).float(), p[1]) > 1e-3
    assert all(len(t) == n + 1 for t, n in zip(out.tokens, out.num_accepted))


def test_identical_draft_and_target_accept_everything() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, K + 1, V, generator=g), dim=-1)
    draft = torch.multinomial(p[:, 0], 1, generator=g)
    draft = torch.cat([draft, torch.multinomial(p[:, 1], 1, generator=g)], dim=1)
    out = rejection_sample(p, draft, p[:, :K], generator=g)
    assert out.num_accepted == [K] * 64


def test_greedy_verification_keeps_the_argmax_prefix() -> None:
    logits = torch.full((3, 4, 10), -1.0)
    for row, best in enumerate([[5, 6, 7, 8], [5, 0, 7, 8], [1, 2, 3, 4]]):
        for pos, token in enumerate(best):
            logits[row, pos, token] = 1.0
    out = verify_greedy(logits, [[5, 6, 7], [5, 6, 7], []])
    assert out.tokens == [[5, 6, 7, 8], [5, 0], [1]]
    assert out.num_accepted == [3, 1, 0]


def test_ngram_proposer() -> None:
    prop = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert prop.propose(tokens) == [4, 5, 1]  # the latest earlier "1 2 3" is followed by 4 5 1
    assert prop.propose([7, 8, 9]) == []
    assert prop.propose([4, 4]) == [4]
    assert NgramProposer(2, 2, 2).propose([1, 2, 5, 1, 2]) == [5, 1]
    with pytest.raises(ValueError):
        NgramProposer(0)


def test_the_default_batch_limit_for_drafts_follows_the_machine():
    """disable_by_batch_size unset: 8 where verifying many rows is cheap (AMX, GPUs), 1 on a CPU without
    AMX (compute-bound int8 kernels: drafting lost from 2 concurrent sequences on); set, it wins."""
    from ferrylm.model.cpu.cpu_isa import this_cpu
    from ferrylm.model.spec.spec_step import max_spec_batch

    unset = SpeculativeConfig("ngram", 4)
    assert max_spec_batch(unset, torch.device("cpu")) == (8 if "amx_tile" in this_cpu().flags else 1)
    assert max_spec_batch(unset, torch.device("cuda")) == 8
    assert max_spec_batch(SpeculativeConfig("ngram", 4, disable_by_batch_size=3), torch.device("cpu")) == 3
