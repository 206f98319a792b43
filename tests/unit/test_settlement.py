"""http/settlement.py: a request settles exactly once, whether its stream ends, is closed before it
starts, is closed after it ended, or fails; and chat_dialect's one rule for Responses and Messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from ferrylm.http.chat_dialect import in_dialect_terms, joined_text
from ferrylm.http.errors import APIError
from ferrylm.http.messages_protocol import MESSAGES
from ferrylm.http.responses_protocol import RESPONSES
from ferrylm.http.settlement import SettledStream, Settlement


def _recording() -> tuple[Settlement, list]:
    calls: list = []

    async def on_settle(status: int, *usage: int | None) -> None:
        calls.append((status, *usage))
    return Settlement(on_settle), calls


async def _events(n: int, fail: bool = False) -> AsyncGenerator[str, None]:
    for i in range(n):
        yield f"e{i}"
    if fail:
        raise RuntimeError("broken")


def test_settles_once_and_records_the_first_status() -> None:
    async def run() -> list:
        settlement, calls = _recording()
        assert not settlement.settled and settlement.status is None
        await settlement.settle(200, 5, 1, 0)
        await settlement.settle(499, None, 0, 0)
        assert settlement.settled and settlement.status == 200
        return calls
    assert asyncio.run(run()) == [(200, 5, 1, 0)]


def test_a_stream_run_to_its_end_settles_200_even_when_closed_after() -> None:
    async def run() -> tuple[list, list]:
        settlement, calls = _recording()
        stream = SettledStream(_events(2), settlement)
        seen = [e async for e in stream]
        await stream.aclose()  # what SSEResponse always does
        return seen, calls
    assert asyncio.run(run()) == (["e0", "e1"], [(200,)])


@pytest.mark.parametrize("read", [0, 1])
def test_a_stream_closed_first_settles_499(read: int) -> None:
    """Client gone before the first byte (never started) or mid-stream."""
    async def run() -> list:
        settlement, calls = _recording()
        stream = SettledStream(_events(3), settlement)
        for _ in range(read):
            await stream.__anext__()
        await stream.aclose()
        return calls
    assert asyncio.run(run()) == [(499,)]


def test_a_failing_stream_settles_when_closed() -> None:
    async def run() -> list:
        settlement, calls = _recording()
        stream = SettledStream(_events(1, fail=True), settlement)
        with pytest.raises(RuntimeError):
            async for _ in stream:
                pass
        await stream.aclose()
        return calls
    assert asyncio.run(run()) == [(499,)]


@pytest.mark.parametrize(("dialect", "content", "message"), [
    (RESPONSES, 3, "Invalid 'where': expected a string or a list of text parts."),
    (RESPONSES, [{"type": "image"}], "Invalid 'where[0]': only text parts are supported (got 'image')."),
    (MESSAGES, 3, "where: expected a string or a list of text blocks."),
    (MESSAGES, [{"type": "input_text", "text": "x"}],
     "where.0: only text blocks are supported here (got 'input_text')."),
])
def test_joined_text_refuses_in_each_dialects_words(dialect, content, message: str) -> None:
    with pytest.raises(APIError) as e:
        joined_text(content, "where", dialect)
    assert e.value.message == message and e.value.status == 400


def test_joined_text_joins_the_dialects_text_parts() -> None:
    assert joined_text([{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}], "w",
                       RESPONSES) == "a\nb"
    assert joined_text([{"type": "text", "text": "a"}], "w", MESSAGES) == "a"
    assert joined_text("plain", "w", MESSAGES) == "plain"


def test_errors_are_renamed_into_the_dialects_fields() -> None:
    error = in_dialect_terms(APIError(400, "'max_completion_tokens' and 'stop' are bad", "stop"), MESSAGES)
    assert (error.message, error.param) == ("'max_tokens' and 'stop_sequences' are bad", "stop_sequences")
    error = in_dialect_terms(APIError(400, "'response_format' is bad", "response_format"), RESPONSES)
    assert (error.message, error.param) == ("'text.format' is bad", "text.format")
