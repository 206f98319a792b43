"""POST /v1/embeddings (OpenAI's format) under `--runner pooling` (vLLM's flag): each input is
prefilled once (no token generated; its blocks are freed, and cached, when it ends) and its final
hidden states pooled into one vector (`--pooler-config`: pooling type last | mean | cls, normalize;
the engine's model/pooling.py). `encoding_format` float or base64 (little-endian float32, what the
openai SDK asks for by default). `dimensions`: the model's own size only (no Matryoshka truncation
here): any other value is a 400 naming it."""

from __future__ import annotations

import base64
import struct
from typing import Any

from ferrylm.http.embeddings_protocol import EmbeddingRequest
from ferrylm.http.errors import invalid
from ferrylm.outputs import RequestOutput
from ferrylm.server.fanout import Fanout
from ferrylm.server.serving import ResponseContext, log_finished, usage


def _encoded(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def embeddings_shaper(request: EmbeddingRequest):
    """app._serve's `shaper`: OpenAI's list of embeddings, in input order, with prompt-only usage."""

    def shape(ctx: ResponseContext, fanout: Fanout, finals: list[RequestOutput]) -> dict[str, Any]:
        vectors = [out.pooled or [] for out in finals]
        size = len(vectors[0]) if vectors else 0
        if request.dimensions is not None and request.dimensions != size:
            raise invalid(f"'dimensions' {request.dimensions}: this model's embeddings have {size} dimensions and "
                          "it does not support truncating them (leave 'dimensions' unset).", "dimensions")
        u = usage(fanout, finals)
        log_finished(ctx, fanout, finals, stream=False)
        return {"object": "list", "model": ctx.model,
                "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, request.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": u.prompt_tokens, "total_tokens": u.prompt_tokens}}

    return shape
