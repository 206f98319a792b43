"""build(config) behind executor.build_executor: one process's ModelRunner, or rank 0 of a
tensor-parallel group wrapped with the ranks it spawned (their liveness and their exit belong to
the executor, not to the engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ferrylm.config import EngineConfig
from ferrylm.executor import BuiltExecutor, ModelOutput
from ferrylm.model.parallel.tp import TPGroup
from ferrylm.model.parallel.tp_worker import Rendezvous, SpawnedRanks, build_runner, from_torchrun
from ferrylm.model.runner import ModelRunner
from ferrylm.scheduler_output import SchedulerOutput


class TensorParallelExecutor:
    """Rank 0's runner, its group and the ranks this process spawned (None under torchrun, which
    owns them). Each step is broadcast here, then every rank runs the same runner.execute on it
    (the others in tp_worker.worker_loop): the runner itself never branches on the broadcast."""

    def __init__(self, runner: ModelRunner, group: TPGroup, ranks: SpawnedRanks | None):
        self.runner, self.group, self.ranks = runner, group, ranks
        self.num_blocks, self.num_host_blocks = runner.num_blocks, runner.num_host_blocks
        self.swap_bytes_per_block = runner.swap_bytes_per_block
        self.vocab_size, self.eos_token_ids = runner.vocab_size, runner.eos_token_ids

    def execute(self, step: SchedulerOutput) -> ModelOutput:
        self.group.broadcast_object(step)  # raises first if a spawned rank has exited
        return self.runner.execute(step)

    def kv_layout(self) -> dict[str, Any]:
        return self.runner.kv_layout()

    def read_kv_blocks(self, block_ids: list[int]) -> Any:
        return self.runner.read_kv_blocks(block_ids)

    def check_kv_blocks(self, data: Any, num_blocks: int) -> None:
        self.runner.check_kv_blocks(data, num_blocks)

    def write_kv_blocks(self, block_ids: list[int], data: Any) -> None:
        self.runner.write_kv_blocks(block_ids, data)

    def kv_disk_entries(self) -> list[tuple[int, int]]:
        return self.runner.kv_disk_entries()  # none: the disk tier refuses tensor parallelism

    def kv_disk_stats(self) -> dict[str, float]:
        return self.runner.kv_disk_stats()

    def add_lora(self, name: str, path: str) -> int:
        """Rank 0 reads and checks the adapter first; only then do the other ranks load their slices."""
        rank = self.runner.add_lora(name, path)
        self.group.broadcast_object(("add_lora", name, path))
        return rank

    def remove_lora(self, name: str) -> None:
        self.group.broadcast_object(("remove_lora", name))
        self.runner.remove_lora(name)

    def use_grammars(self, compiled: Callable[[str], Any] | None) -> None:
        self.runner.use_grammars(compiled)  # rank 0 samples: the other ranks never need a grammar

    def dead(self) -> str | None:
        return self.ranks.dead() if self.ranks is not None else None

    def shutdown(self) -> None:
        """Tell the other ranks to exit (None ends worker_loop), then wait for those this process spawned."""
        self.runner.shutdown()
        try:
            self.group.broadcast_object(None)
        except RuntimeError:
            pass  # a rank already gone
        if self.ranks is not None:
            self.ranks.join()
            self.ranks = None


def build(config: EngineConfig) -> BuiltExecutor:
    if config.tensor_parallel_size == 1:
        runner, source, max_model_len = build_runner(config)
        return BuiltExecutor(runner, source, max_model_len)
    group, ranks = _join(config)
    try:
        runner, source, max_model_len = build_runner(config, group)
    except BaseException:
        if ranks is not None:
            ranks.join(timeout=0)
        raise
    return BuiltExecutor(TensorParallelExecutor(runner, group, ranks), source, max_model_len)


def _join(config: EngineConfig) -> tuple[TPGroup, SpawnedRanks | None]:
    """Rank 0's group, and the spawned ranks (None under torchrun, which started them)."""
    world = config.tensor_parallel_size
    place = from_torchrun(world)
    ranks = None
    if place is None:
        ranks = SpawnedRanks(config, world)
        place = Rendezvous("127.0.0.1", ranks.port, 0, world)
    elif place.rank != 0:
        raise RuntimeError("only rank 0 builds the engine; the other ranks run tp_worker.worker_loop")
    group = TPGroup(place.host, place.port, 0, world, agent_store=place.agent_store)
    if ranks is not None:
        group.peers_dead = ranks.dead
    return group, ranks
