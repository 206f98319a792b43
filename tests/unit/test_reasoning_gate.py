"""ReasoningGate over a real xgrammar matcher: every token passes while the output thinks, the grammar
takes over after the closing tokens (one or several), qwen3's optional opening token is allowed beside
the grammar's at the first position only, and rollback (speculative verification) restores all of it."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.structured.reasoning_gate import ReasoningGate

xgrammar = pytest.importorskip("xgrammar")
VOCAB = [f"w{i}" for i in range(40)]
VOCAB[3], VOCAB[4], VOCAB[5], VOCAB[31], VOCAB[39] = "x", "y", "</think>", "<think>", "<eos>"
X, Y, END, START, EOS = 3, 4, 5, 31, 39


def matcher():
    info = xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_regex("xy"))


def allowed(gate: ReasoningGate) -> set[int]:
    bitmask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
    gate.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, len(VOCAB))
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    return {i for i in range(len(VOCAB)) if logits[0, i] == 0}


def test_thinking_is_free_and_the_grammar_starts_after_the_end_token():
    gate = ReasoningGate(matcher(), end=(END,))
    assert allowed(gate) == set(range(len(VOCAB)))
    assert gate.accept_token(7) and gate.accept_token(Y) and not gate.is_terminated()
    assert gate.accept_token(END) and allowed(gate) == {X}
    assert not gate.accept_token(Y)  # refused by the grammar, the gate unchanged
    assert gate.accept_token(X) and gate.accept_token(Y) and allowed(gate) == {EOS}
    assert gate.accept_token(EOS) and gate.is_terminated()


def test_a_closing_tag_of_several_tokens_and_rollback_across_it():
    gate = ReasoningGate(matcher(), end=(8, 9))
    for token in (8, 1, 8, 9):  # 8 alone does not close it
        assert gate.accept_token(token)
    assert allowed(gate) == {X} and gate.accept_token(X)
    gate.rollback(2)  # back inside the thinking, before the 9 and the x
    assert gate.state == "thinking" and allowed(gate) == set(range(len(VOCAB)))
    assert gate.accept_token(9) and allowed(gate) == {X}  # the matcher was rolled back too


def test_qwen3_allows_the_opening_token_beside_the_grammar_at_first_only():
    gate = ReasoningGate(matcher(), end=(END,), start=START)
    assert allowed(gate) == {X, START}  # START is bit 31 of its word (an int32 sign bit)
    assert gate.accept_token(START) and allowed(gate) == set(range(len(VOCAB)))
    assert gate.accept_token(END) and allowed(gate) == {X}
    direct = ReasoningGate(matcher(), end=(END,), start=START)
    assert direct.accept_token(X) and allowed(direct) == {Y}  # no thinking: the answer from the first token
    assert not direct.accept_token(START)
