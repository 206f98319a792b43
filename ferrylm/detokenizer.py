"""Incremental detokenization and stop-string matching for streamed output.

Decoding one token at a time is wrong for byte-level BPE (a CJK char or emoji
spans several tokens) and for SentencePiece (a token's leading space depends on
its left neighbour), while re-decoding the whole output each step is O(n^2).
Like vLLM's ``detokenize_incrementally``, we decode only a small window of
recent tokens ``[prefix_offset:]``, emit the part beyond the already-emitted
``[prefix_offset:read_offset]`` text, and hold text back while it ends in
U+FFFD (an incomplete UTF-8 sequence).  On top of that, stop strings are
matched on the emitted text, holding back any tail that could still grow into
a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context so the first output token decodes with
# the same leading-space handling as in the full sequence (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 char is at most 4 bytes, so a legitimately incomplete char never
# needs this many tokens; a longer run of U+FFFD-terminated text is garbage
# bytes from the model, and we emit it rather than let the window (and the
# per-token cost) grow without bound.
MAX_HELD_TOKENS = 32


class DetokenizerDelta(NamedTuple):
    """What one engine step contributes to a request's streamed text."""

    text: str  # new text to send to the client this step (may be "")
    stop_reason: str | int | None  # the stop string matched, else None


class IncrementalDetokenizer:
    """Turns a request's generated token ids into streamed text deltas.

    The concatenation of all ``add_tokens(...).text`` plus ``flush()`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (truncated at the
    first stop string, if any), and no delta carries a U+FFFD produced by a
    character split across tokens.  Each step costs O(window + stop strings),
    independent of the output length.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]  # "" would match everywhere
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output

        # Window of token strings starting at prefix_offset; only this tail of
        # the sequence is ever decoded, so we don't keep the rest.
        tail_ids = list(prompt_token_ids[-(PROMPT_CONTEXT_TOKENS + 2):])
        window = tokenizer.convert_ids_to_tokens(tail_ids, skip_special_tokens=skip_special_tokens)
        window = [t for t in window if t is not None]  # ids past the tokenizer's vocab (padded embeddings)
        self._window: list[str] = list(window[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_text: str = tokenizer.convert_tokens_to_string(self._window) if self._window else ""
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # Prompt ends mid-character: its text can't be a stable prefix, so
            # decode the output on its own (as tokenizer.decode(output) would).
            self._window, self._prefix_text = [], ""
        self._read = len(self._window)  # read_offset, relative to the window

        self._held = ""  # decoded text withheld because it may start a stop string
        self._output_text = ""  # everything emitted so far
        self._stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far (after any stop-string truncation)."""
        return self._output_text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, if any."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later tokens are ignored."""
        return self._stop_reason is not None

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Decode this step's new token(s) and return the text to emit.

        After a stop string matched, returns an empty delta (an engine that
        schedules ahead may still hand us a token it already sampled).
        """
        if self.finished:
            return DetokenizerDelta("", None)
        tokens = self._tokenizer.convert_ids_to_tokens(list(token_ids), skip_special_tokens=self._skip_special)
        # A model whose vocab is padded past the tokenizer's (Qwen2) may sample an id with no
        # text: it decodes to nothing, as tokenizer.decode renders it.
        tokens = [t for t in tokens if t is not None]
        new_text = "".join([self._decode_next(t) for t in tokens])
        text = self._apply_stop(new_text, final=False)
        return DetokenizerDelta(text, self._stop_reason)

    def flush(self) -> str:
        """Release all held-back text when the request ends without a stop
        string (EOS, stop token, max_tokens), so no text is lost.

        A trailing incomplete character is emitted as U+FFFD, exactly as
        ``tokenizer.decode`` renders it.
        """
        if self.finished:
            return ""
        pending = ""
        if len(self._window) > self._read:
            full = self._tokenizer.convert_tokens_to_string(self._window)
            pending = full[len(self._prefix_text):]
            self._window, self._read, self._prefix_text = [], 0, ""
        return self._apply_stop(pending, final=True)

    def _decode_next(self, token: str) -> str:
        """Append one token to the window; return newly completed text."""
        self._window.append(token)
        full = self._tokenizer.convert_tokens_to_string(self._window)
        held_tokens = len(self._window) - self._read
        if held_tokens < MAX_HELD_TOKENS and (
            len(full) <= len(self._prefix_text) or full.endswith(REPLACEMENT_CHAR)
        ):
            return ""  # nothing new yet, or the last char is still incomplete
        delta = full[len(self._prefix_text):]
        if held_tokens >= MAX_HELD_TOKENS:
            # Garbage bytes: restart the window so its cost stays bounded.
            self._window, self._read, self._prefix_text = [], 0, ""
            return delta
        # Slide: the just-read tokens become the next step's left context.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._tokenizer.convert_tokens_to_string(self._window)
        return delta

    def _apply_stop(self, new_text: str, *, final: bool) -> str:
        """Match stop strings over held + new text; return the emittable part.

        Only ``held`` (< longest stop string) plus this step's text is scanned,
        so a stop string split across tokens or steps is still found.
        """
        if not self._stop:
            self._output_text += new_text
            return new_text
        buf = self._held + new_text
        match = self._earliest_stop(buf)
        if match is not None:
            index, stop_str = match
            end = index + len(stop_str) if self._include_stop else index
            emit, self._held, self._stop_reason = buf[:end], "", stop_str
        else:
            keep = 0 if final else self._partial_stop_len(buf)
            emit, self._held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self._output_text += emit
        return emit

    def _earliest_stop(self, buf: str) -> tuple[int, str] | None:
        """The stop string occurrence that completes first in buf.

        Ordering by end position (then start) is what a token-by-token stream
        sees, so the result doesn't depend on how tokens are batched per step.
        """
        best: tuple[int, int, str] | None = None
        for stop_str in self._stop:
            index = buf.find(stop_str)
            if index != -1:
                key = (index + len(stop_str), index, stop_str)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, buf: str) -> int:
        """Length of buf's longest suffix that is a proper prefix of a stop string.

        Holding back only that (rather than vLLM's flat longest-1 chars) keeps
        streaming latency low while never emitting part of a stop string.
        """
        for k in range(min(len(buf), self._max_stop_len - 1), 0, -1):
            suffix = buf[-k:]
            if any(s.startswith(suffix) for s in self._stop):
                return k
        return 0
