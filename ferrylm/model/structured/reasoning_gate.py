"""Structured output that constrains a reasoning model's answer, not its thinking (vLLM's default,
`enable_in_reasoning` off): a wrapper around a request's xgrammar matcher that lets every token through
until the output has closed its thinking (`</think>`'s tokens), then hands over to the grammar.

`start` (the qwen3 parser: thinking only when the output opens with `<think>`, a single token): at the
first position the grammar's tokens and `<think>` are allowed; `<think>` opens the thinking, any other
token is the answer's first. Without `start` (deepseek_r1) the output starts inside the thinking.

It answers the matcher calls the runner and speculative verification make (fill_next_token_bitmask,
accept_token, rollback, is_terminated), so neither knows it is there."""

from __future__ import annotations

from typing import Any

THINKING, FIRST, ANSWER = "thinking", "first", "answer"


class ReasoningGate:
    def __init__(self, matcher: Any, end: tuple[int, ...], start: int | None = None):
        if not end:
            raise ValueError("a reasoning gate needs the tokens that close the thinking")
        self.matcher, self.end, self.start = matcher, end, start
        self.state = FIRST if start is not None else THINKING
        self._tail: list[int] = []  # the thinking's tokens (to find `end` in)
        self._history: list[tuple[str, int, bool]] = []  # per accepted token: state, tail length, fed

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        if self.state == THINKING:
            bitmask[row].fill_(-1)  # every bit set: every token allowed
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == FIRST and self.start is not None:
            word, bit = divmod(self.start, 32)
            value = 1 << bit
            bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value  # int32 words

    def accept_token(self, token: int) -> bool:
        before = (self.state, len(self._tail))
        fed = False
        if self.state == THINKING:
            self._tail.append(token)
            if tuple(self._tail[-len(self.end):]) == self.end:
                self.state = ANSWER
        elif self.state == FIRST and token == self.start:
            self.state = THINKING
        else:
            if not self.matcher.accept_token(token):
                return False
            fed, self.state = True, ANSWER
        self._history.append((*before, fed))
        return True

    def rollback(self, num_tokens: int) -> None:
        fed = 0
        for _ in range(num_tokens):
            self.state, tail, was_fed = self._history.pop()
            del self._tail[tail:]
            fed += was_fed
        if fed:
            self.matcher.rollback(fed)

    def is_terminated(self) -> bool:
        return self.state == ANSWER and self.matcher.is_terminated()
