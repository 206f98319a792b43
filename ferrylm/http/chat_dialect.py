"""What the Responses and Messages APIs share as dialects of the chat request each becomes: the
text of a content field (a string or a list of text parts) and an error about the chat request
renamed into the dialect's own field names. One rule, each API's own words."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrylm.http.errors import APIError, invalid


@dataclass(frozen=True)
class ChatDialect:
    """How one API that runs as a chat request names things."""

    text_kinds: tuple[str, ...]  # the part types whose `text` is the content's text
    not_a_list: str  # the error for content neither a string nor a list ({where})
    not_text: str  # the error for a part that is not text ({where}, {j}, {kind})
    params: Mapping[str, str]  # chat field an error names (its param) → the dialect's field
    quoted: tuple[tuple[str, str], ...]  # chat field quoted in an error's message → the dialect's


def joined_text(content: Any, where: str, dialect: ChatDialect) -> str:
    """The text of a string or of a list of text parts (joined by newlines); 400 otherwise."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(dialect.not_a_list.format(where=where), where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in dialect.text_kinds \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(dialect.not_text.format(where=where, j=j, kind=kind), f"{where}.{j}.type")
        texts.append(part["text"])
    return "\n".join(texts)


def in_dialect_terms(error: APIError, dialect: ChatDialect) -> APIError:
    """An error about the chat request the dialect's request became, naming the dialect's fields."""
    error.param = dialect.params.get(error.param or "", error.param)
    for chat, own in dialect.quoted:
        error.message = error.message.replace(f"'{chat}'", f"'{own}'")
    return error
