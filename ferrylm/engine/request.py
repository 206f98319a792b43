"""Request: one sequence's state inside the engine (token ids, progress, status, timings)."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ferrylm.engine.block_manager import root_hash
from ferrylm.outputs import FinishReason, RequestMetrics
from ferrylm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV blocks: waits to be re-prefilled
    SWAPPED = "swapped"  # its KV blocks are in host memory: waits (in the waiting queue) to be swapped in
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A single sequence (n > 1 is fanned out above the engine into n Requests).

    `token_ids` is prompt followed by output; `num_computed_tokens` of them have K/V in the cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None inside the engine
    arrival_time: float
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    grammar: Future[Any] | None = None  # structured output: compiling off the engine thread; admitted once done
    spec_token_ids: list[int] = field(default_factory=list)  # the runner's draft for the next step
    num_new_tokens: int = 0  # tokens the last step appended (more than one when a draft was accepted)
    lora_name: str | None = None  # the LoRA adapter it runs through (None: the base model)
    lora_generation: int = 0  # which load of that name (a name loaded again with other weights is another cache)
    disk_checked: bool = False  # its prompt's blocks were read up from the disk tier, or will not be
    disk_waits: int = 0  # steps it waited for host blocks to read them into
    probed_cached_tokens: int = 0  # its prompt's prefix cached in some tier when it arrived (admission's estimate)
    metrics: RequestMetrics = field(init=False)  # timestamps, from arrival_time on
    cache_root: int = field(init=False)  # its prefix-cache chain's root: root_hash(cache_salt, the adapter's load)
    tenant_root: int = field(init=False)  # root_hash(cache_salt): tells tenants apart (decode isolation)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.tenant_root = root_hash(self.sampling_params.cache_salt)
        adapter = None if self.lora_name is None else f"{self.lora_name}#{self.lora_generation}"
        self.cache_root = root_hash(self.sampling_params.cache_salt, adapter)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def grammar_ref(self) -> str | None:
        """The runner's handle on this request's compiled grammar (a plain string), if it has one."""
        spec = self.sampling_params.structured_outputs
        return spec.ref() if self.grammar is not None and spec is not None else None

    @property
    def grammar_pending(self) -> bool:
        """Not schedulable yet: its grammar still compiles, or failed (the engine aborts it)."""
        return self.grammar is not None and (not self.grammar.done() or self.grammar.exception() is not None)

    @property
    def sort_key(self) -> tuple[int, float, str]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id)
