"""--reasoning-parser: splitting `<think>...</think>` from the answer, whole and streamed (any chunking
gives what the whole output gives), and an earlier turn's thinking kept for the chat template."""

from __future__ import annotations

import random

import pytest

from ferrylm.http.prompt_ids import _message_dict
from ferrylm.http.protocol import ChatMessage
from ferrylm.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream, parser_for


@pytest.mark.parametrize("name, text, want", [
    ("deepseek_r1", "<think>plan</think>Paris", ("plan", "Paris")),
    ("deepseek_r1", "plan</think>Paris", ("plan", "Paris")),  # the template opened the thinking
    ("deepseek_r1", "still thinking", ("still thinking", None)),
    ("deepseek_r1", "<think>a</think>", ("a", None)),
    ("qwen3", "<think>plan</think>\n\nParis", ("plan", "\n\nParis")),
    ("qwen3", "Paris", (None, "Paris")),  # thinking off: all answer
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "plan</think>Paris", (None, "plan</think>Paris")),
])
def test_split(name, text, want):
    assert ReasoningParser(name).split(text) == want


def _streamed(parser: ReasoningParser, text: str, rng: random.Random) -> tuple[str, str]:
    stream, reasoning, content, i = ReasoningStream(parser), "", "", 0
    while i < len(text):
        step = rng.randint(1, 6)
        r, c = stream.feed(text[i:i + step])
        reasoning, content, i = reasoning + r, content + c, i + step
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_any_chunking_streams_what_the_whole_output_splits_into(name):
    parser = ReasoningParser(name)
    rng = random.Random(7)
    pieces = ["<think>", "</think>", "<", "</", "<th", "think", ">", "a", "b c", "\n", "</thin", "x<y"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        reasoning, content = parser.split(text)
        assert _streamed(parser, text, rng) == (reasoning or "", content or ""), text


def test_unknown_parser_is_refused():
    assert parser_for(None) is None and parser_for("qwen3") == ReasoningParser("qwen3")
    with pytest.raises(ValueError, match="deepseek_r1"):
        parser_for("nope")


def test_an_earlier_turns_thinking_goes_to_the_chat_template_under_either_name():
    for field in ("reasoning_content", "reasoning"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "Paris", field: "recall capitals"})
        assert _message_dict(message)["reasoning_content"] == "recall capitals"
    assert "reasoning_content" not in _message_dict(ChatMessage(role="assistant", content="Paris"))
