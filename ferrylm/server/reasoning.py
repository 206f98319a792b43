"""--reasoning-parser (vLLM's flag): the thinking a reasoning model writes between `<think>` and
`</think>` is split from its answer. Chat returns it as `message.reasoning` (and `reasoning_content`,
the older name), streamed as deltas of the same fields; Responses as a `reasoning` item; Messages
as a `thinking` block. Tool calls are parsed from the answer only, and a structured-output constraint
or forced tool call applies to the answer only (`answer_only`; --structured-outputs-config
'{"enable_in_reasoning": true}' applies it from the first token, thinking included).

Parsers: `deepseek_r1` (R1 and its distills: their chat template opens the thinking, so the output
may start inside it: everything before `</think>` is thinking, all of it while `</think>` has not
come) and `qwen3` (thinking only when the output opens with `<think>`; without a closing tag, an
output that opened one is all thinking)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrylm.sampling_params import StructuredOutputsParams
    from ferrylm.tokenizer import Tokenizer

REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    @property
    def opens_implicitly(self) -> bool:
        return self.name == "deepseek_r1"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        opened = text.startswith(self.start)
        if not opened and not self.opens_implicitly:
            return None, text
        body = text[len(self.start):] if opened else text
        cut = body.find(self.end)
        if cut < 0:
            return body, None
        return body[:cut], body[cut + len(self.end):] or None


def answer_only(constraint: StructuredOutputsParams, parser: ReasoningParser,
                tokenizer: Tokenizer) -> StructuredOutputsParams:
    """`constraint` applied to the answer only (vLLM's default): from after `</think>`'s tokens, and,
    for qwen3, `<think>` allowed as the first token when it is one token (else the constraint applies
    from the first token: such a tokenizer cannot tell the opening tag from an answer beginning with it)."""
    end = tuple(tokenizer.encode(parser.end, add_special_tokens=False))
    start: int | None = None
    if not parser.opens_implicitly:
        start_ids = tokenizer.encode(parser.start, add_special_tokens=False)
        if len(start_ids) != 1:
            return constraint
        start = start_ids[0]
    return dataclasses.replace(constraint, reasoning_end=end, reasoning_start=start)


def _last(ids: list[int], pattern: list[int]) -> int:
    """Where the last occurrence of `pattern` in `ids` starts, or -1."""
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == pattern:
            return i
    return -1


def closed_in_prompt(parser: ReasoningParser, tokenizer: Tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt itself closed the thinking (its last tag is `</think>`: a template that turns
    thinking off writes `<think></think>`, an assistant prefill may close it): the output is all answer."""
    end = _last(prompt, tokenizer.encode(parser.end, add_special_tokens=False))
    return end >= 0 and end > _last(prompt, tokenizer.encode(parser.start, add_special_tokens=False))


def for_prompt(parser: ReasoningParser | None, tokenizer: Tokenizer, prompt: list[int]) -> ReasoningParser | None:
    """The parser a request's output is split with: none for deepseek_r1 when the prompt closed the
    thinking (the output starts in the answer; qwen3 only sees thinking that the output opens anyway)."""
    if parser is not None and parser.opens_implicitly and closed_in_prompt(parser, tokenizer, prompt):
        return None
    return parser


def parser_for(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; choose one of {', '.join(REASONING_PARSERS)}")
    return ReasoningParser(name)


class ReasoningStream:
    """One streamed output: `feed(delta)` → (reasoning delta, content delta) that may go out now.
    A suffix that could be the start of a tag is held back until the next delta tells."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already given out (as reasoning or content)
        self.state = "start"  # start (the opening tag may still come) | reasoning | content

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning, content = "", ""
        if self.state == "start":
            p = self.parser
            if len(self.text) < len(p.start) and p.start.startswith(self.text):
                return "", ""  # could still be the opening tag
            if self.text.startswith(p.start):
                self.state, self.sent = "reasoning", len(p.start)
            else:
                self.state = "reasoning" if p.opens_implicitly else "content"
        if self.state == "reasoning":
            cut = self.text.find(self.parser.end, self.sent)
            if cut < 0:
                safe = self._safe_end(self.parser.end)
                reasoning, self.sent = self.text[self.sent:safe], max(self.sent, safe)
                return reasoning, ""
            reasoning = self.text[self.sent:cut]
            self.state, self.sent = "content", cut + len(self.parser.end)
        content, self.sent = self.text[self.sent:], len(self.text)
        return reasoning, content

    def step(self, delta: str, finished: bool) -> tuple[str, str]:
        """feed(delta), plus what was held back when the output ends with it."""
        reasoning, answer = self.feed(delta)
        if finished:
            rest_reasoning, rest_answer = self.finish()
            reasoning, answer = reasoning + rest_reasoning, answer + rest_answer
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        rest, self.sent = self.text[self.sent:], len(self.text)
        if self.state == "start":
            return ("", rest) if not self.parser.opens_implicitly else (rest, "")
        return (rest, "") if self.state == "reasoning" else ("", rest)

    def _safe_end(self, tag: str) -> int:
        """How far `text` may go out: up to a suffix that could begin `tag`."""
        for k in range(min(len(tag) - 1, len(self.text) - self.sent), 0, -1):
            if tag.startswith(self.text[-k:]):
                return len(self.text) - k
        return len(self.text)


def split_delta(stream: ReasoningStream | None, delta: str, finished: bool) -> tuple[str, str]:
    """(reasoning, answer) of one streamed delta; all answer without a parser."""
    return stream.step(delta, finished) if stream is not None else ("", delta)
