"""OpenAI's embeddings request (POST /v1/embeddings), shared by `ferrylm serve --runner pooling`
(server/embeddings.py) and `ferrylm gateway`, which counts and routes it as the prompt-only
completion request it runs as."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ferrylm.http.errors import parse_model
from ferrylm.http.protocol import CompletionRequest


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # anything else would be ignored: refused by name instead

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    priority: int | None = 0  # vLLM's
    cache_salt: str | None = None  # vLLM's: the gateway sets it per tenant (prefix-cache isolation)
    stream: ClassVar[bool] = False  # what app._serve asks of a request


def as_completion_request(request: EmbeddingRequest) -> CompletionRequest:
    """The prompt-only completion request an embeddings request runs as (its inputs tokenized and
    checked the same way; no token generated)."""
    return parse_model(CompletionRequest, {"model": request.model, "prompt": request.input, "max_tokens": 0})
