"""SchedulerOutput: the one bridge from the engine (ids, counts) to the model runner (tensors).

A leaf module, so model/ reads what the scheduler decided without importing engine/."""

from __future__ import annotations

from typing import NamedTuple

from ferrylm.sampling_params import SamplingParams


class NewRequestData(NamedTuple):
    """Sent to the runner the first time a request is scheduled, so it can set up sampling state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # the structured-output grammar's reference (StructuredOutputsParams.ref; compiled before the request
    # is scheduled), resolved by the sampling rank through the engine's grammar compiler
    grammar: str | None = None
    lora_name: str | None = None  # the LoRA adapter its rows run through (None: the base model)


class ScheduledRequest(NamedTuple):
    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    num_computed_tokens: int  # tokens already in the cache before this step
    block_ids: list[int]
    sample: bool  # True when this chunk reaches the end of the known tokens
    # Speculative decoding: proposed tokens, the tail of token_ids; their K/V is computed and the
    # target's logits at every one of them verify the draft (not yet part of the request)
    draft_token_ids: tuple[int, ...] = ()


class DiskOrders(NamedTuple):
    """The disk tier's file work this step (engine/disk_tier.py, model/kv_disk.py), in the runner's
    order: deletes, then writes gathered from the device before any copy (queued to a writer thread
    behind earlier steps' writes), then reads into host blocks after the copies out and before the
    copies in."""

    writes: tuple[tuple[int, int, int], ...] = ()  # (device block id, block hash, owner)
    reads: tuple[tuple[int, int, int], ...] = ()  # (block hash, owner, host block id)
    deletes: tuple[tuple[int, int], ...] = ()  # (block hash, owner)
    flush: bool = False  # the shutdown's flush: writes wait for room in the write queue instead of being dropped

    def __bool__(self) -> bool:
        return bool(self.writes or self.reads or self.deletes)


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_ids: list[str]  # requests the runner can forget (finished since the last step)
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()  # their KV blocks were freed this step (recomputed when resumed)
    # Swap preemption (engine/host_pool.py), copied by the runner before this step's forward:
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()  # (device block id, host block id)
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()  # (host block id, device block id)
    disk: DiskOrders = DiskOrders()  # the prefix cache's disk tier (--kv-offload-disk-path)
