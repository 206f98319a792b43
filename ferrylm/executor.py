"""The seam between the engine (ids, counts) and the model side (tensors): what the engine may call
on an executor, what one step returns, and how an executor is built. Torch-free: engine/ imports
only this module from the model side, and reads nothing else of it.

An executor is one process's ModelRunner (model/runner.py) or, with --tensor-parallel-size > 1,
rank 0's runner wrapped with the ranks it spawned (model/parallel/executor.py); vLLM calls the same
idea its Executor."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ferrylm.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from ferrylm.config import EngineConfig
    from ferrylm.tokenizer import Tokenizer


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served on this model (unreadable, too large a rank, a module
    it cannot be applied to); the message names the adapter and the reason."""


class TokenLogprobs(NamedTuple):
    """Logprob of a sampled token and the top alternatives, the chosen token first."""

    entries: dict[int, float]


class PromptLogprob(NamedTuple):
    """One scored prompt token."""

    position: int  # index in the prompt of the token scored (1.. : the first has none)
    entries: dict[int, float]  # that token's logprob first, then the top-k alternatives
    rank: int  # 1 + the number of tokens the model found more likely


class ModelOutput(NamedTuple):
    """What one step produced, by request id."""

    sampled: dict[str, int]  # request id → next token
    logprobs: dict[str, TokenLogprobs]  # only for requests that asked for logprobs
    prompt_logprobs: dict[str, list[PromptLogprob]] = {}  # this step's scored prompt tokens (never mutated)
    accepted: dict[str, list[int]] = {}  # draft tokens the target kept, emitted before `sampled` (never mutated)
    draft_token_ids: dict[str, list[int]] = {}  # proposals for the next step (never mutated)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = {}  # of the `accepted` tokens, when asked (never mutated)
    pooled: dict[str, list[float]] = {}  # --runner pooling: a request's vector, at its prompt's end (never mutated)
    # block hashes whose disk-tier file is missing, corrupt or another model's (this step's reads), or
    # whose write failed since the last step (a full disk): the engine forgets them
    kv_disk_lost: tuple[int, ...] = ()


class Executor(Protocol):
    """Everything the engine may ask of the model side."""

    num_blocks: int  # KV blocks allocated on the device
    num_host_blocks: int  # host blocks allocated for swap preemption
    swap_bytes_per_block: int  # bytes one swapped block moves (the preemption cost model's unit)
    vocab_size: int
    eos_token_ids: list[int]

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        """Run one scheduled step (swap copies first); forget finished requests."""
        ...

    def kv_layout(self) -> dict[str, Any]:
        """What two engines must share for their KV blocks to be exchangeable (kv_transfer.py)."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> Any:
        ...

    def check_kv_blocks(self, data: Any, num_blocks: int) -> None:
        """ValueError unless `data` is exactly what read_kv_blocks gives for `num_blocks` blocks."""
        ...

    def write_kv_blocks(self, block_ids: list[int], data: Any) -> None:
        ...

    def kv_disk_entries(self) -> list[tuple[int, int]]:
        """(block hash, owner) of the disk tier's files found at start, oldest first (model/kv_disk.py)."""
        ...

    def kv_disk_stats(self) -> dict[str, float]:
        """The disk tier's bytes_written, bytes_read and read_seconds so far (zeros without one)."""
        ...

    def use_grammars(self, compiled: Callable[[str], Any] | None) -> None:
        """Where the grammar references of structured-output requests resolve to compiled grammars."""
        ...

    def dead(self) -> str | None:
        """A line naming a part of the executor that exited (a tensor-parallel rank), else None."""
        ...

    def shutdown(self) -> None:
        ...

    def add_lora(self, name: str, path: str) -> int:
        """Read and check the peft adapter at `path` under `name` (replacing one of that name); its
        rank. Raises LoRAError (or ConfigError when the executor serves no adapters)."""
        ...

    def remove_lora(self, name: str) -> None:
        """Forget the adapter (the engine first makes sure no request of it is running)."""
        ...


class BuiltExecutor(NamedTuple):
    executor: Executor
    source: Any  # model/loaders/model_source.ModelSource: where the tokenizer is loaded from
    max_model_len: int


def build_executor(config: EngineConfig) -> BuiltExecutor:
    """The executor `config` describes: one process, or rank 0 of a tensor-parallel group (its
    other ranks spawned here, or joined under torchrun). Loads the model."""
    from ferrylm.model.parallel.executor import build  # torch: only once an engine is really built

    return build(config)


def build_grammar_compiler(tokenizer: Tokenizer, vocab_size: int, compile_timeout_s: float,
                           compile_memory_mb: int) -> Any:
    """The structured-output compiler for `tokenizer` (model/structured/structured_output.GrammarCompiler), or
    None for a tokenizer without a Hugging Face twin. Nothing is compiled until a request asks."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    from ferrylm.model.structured.structured_output import GrammarCompiler, GrammarLimits

    limits = GrammarLimits(compile_timeout_s=compile_timeout_s, compile_memory_bytes=compile_memory_mb << 20)
    return GrammarCompiler(hf, vocab_size, tuple(tokenizer.eos_token_ids), limits)
