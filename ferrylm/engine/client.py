"""EngineClient: everything `server/` may know of an engine. The in-process AsyncEngine is one;
an out-of-process or tensor-parallel engine (M2.6) is another, and plugs in without touching the
handlers, which never reach through to the Engine, its tokenizer or its config."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from ferrylm.engine.adapters import LoRAInfo
from ferrylm.load_report import LoadReport
from ferrylm.outputs import RequestOutput, RequestOutputKind
from ferrylm.sampling_params import SamplingParams, StructuredOutputsParams
from ferrylm.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine stopped (its loop crashed); the server answers 503 until restarted."""


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs of the served model: to tokenize, validate and describe requests.
    (The names clients use for it are the server's own: ServerConfig.served_model_names.)"""

    model: str  # what was loaded (--model): the model card's `root`
    tokenizer: Tokenizer
    vocab_size: int  # the model's (embedding rows), which token ids must stay below
    max_model_len: int
    block_size: int  # KV block size: prefix-cache hashes are per full block (router affinity)


class RequestStreamLike(Protocol):
    """One request's outputs; `aclose()` before the end aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    """The engine as the HTTP layer sees it."""

    model_info: ModelInfo
    error: BaseException | None  # why it stopped, if it did

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                          lora_name: str | None = None) -> RequestStreamLike: ...

    async def load_lora(self, name: str, path: str) -> LoRAInfo: ...  # LoRAError, AdapterBusy

    async def unload_lora(self, name: str) -> None: ...  # KeyError, AdapterBusy

    def lora_adapters(self) -> list[LoRAInfo]: ...

    async def prepare_structured_output(self, spec: StructuredOutputsParams) -> None: ...
    # compiles (cached) the constraint; raises ValueError with `param` when it cannot be enforced

    async def export_prefix_kv(self, token_ids: list[int], cache_salt: str | None = None) -> bytes: ...
    # kv_transfer wire bytes

    async def import_prefix_kv(self, body: bytes) -> int: ...  # blocks written; ValueError on a bad body

    def stats(self) -> LoadReport: ...

    async def check_health(self) -> None: ...  # raises EngineDeadError when it cannot serve

    @property
    def is_running(self) -> bool: ...

    @property
    def errored(self) -> bool: ...

    def seconds_since_heartbeat(self) -> float: ...
