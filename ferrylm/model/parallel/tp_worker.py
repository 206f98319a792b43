"""Tensor-parallel ranks: building each rank's runner, and the loop of ranks 1..N-1.

`ferrylm serve --tensor-parallel-size N` (and LLM(tensor_parallel_size=N)) spawns ranks 1..N-1 as
processes on this machine; the engine process is rank 0. Under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set) nothing is spawned: every process runs the same command, rank 0
serves and the others run `worker_loop`. Each step rank 0's executor broadcasts the SchedulerOutput
(ids only) and every rank runs the same ModelRunner.execute on it; only rank 0 samples, so ranks
never diverge. A rank that dies makes rank 0's next step raise (the engine then fails stop,
/health answers 503).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from ferrylm.config import EngineConfig

log = logging.getLogger("ferrylm.tp")


class Rendezvous(NamedTuple):
    host: str
    port: int
    rank: int
    world: int
    agent_store: bool = False  # torchrun's agent hosts the store at `port`: every rank joins it as a client


def from_torchrun(world: int, environ: Mapping[str, str] | None = None) -> Rendezvous | None:
    """This process's place when torchrun (or a launcher setting the same variables) started it for
    a world of `world` ranks, else None. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) every rank
    joins the agent's store at MASTER_PORT, as torch's env:// does; otherwise rank 0 hosts it there.
    (A store of our own on MASTER_PORT + 1 could find that port taken by an ephemeral connection.)"""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    if int(env.get("WORLD_SIZE", "1")) != world:
        raise RuntimeError(f"torchrun started {env.get('WORLD_SIZE')} processes for --tensor-parallel-size {world}")
    return Rendezvous(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]), world,
                      env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def build_runner(config: EngineConfig, tp_group: Any = None, compile_in_child: bool = True) -> tuple[Any, Any, int]:
    """(ModelRunner, ModelSource, max_model_len) of `config`, for one rank when `tp_group` is given.
    `compile_in_child`: the CPU decode graphs compile in a child process (compile_worker.py)."""
    from ferrylm.model.compile.compile_worker import compile_in_child as compile_elsewhere
    from ferrylm.model.cpu.cpu_plan import plan_cpu
    from ferrylm.model.cpu.cpu_threads import configure_cpu_threads
    from ferrylm.model.device import resolve_device, resolve_dtype
    from ferrylm.model.loaders.loader import Checkpoint
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.model.runner import ModelRunner

    source = resolve_model(config.model)
    checkpoint = Checkpoint(source)
    max_model_len = config.scheduler.max_model_len or checkpoint.config.max_position_embeddings
    device = resolve_device(config.device)
    int8_activations = False
    if device.type == "cpu":
        plan = plan_cpu(config.dtype, configure_cpu_threads())
        log.info("%s", plan.describe())
        int8_activations = plan.int8_activations
    runner = ModelRunner(checkpoint, config.cache, resolve_dtype(config.dtype, device), device, max_model_len,
                         config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                         enforce_eager=config.enforce_eager, quantization=config.quant,
                         speculative=config.speculative, tp=tp_group, int8_activations=int8_activations,
                         expert_parallel=config.enable_expert_parallel,
                         compile_elsewhere=(lambda: compile_elsewhere(config)) if compile_in_child else None,
                         lora=config.lora)
    return runner, source, max_model_len


def worker_loop(config: EngineConfig, place: Rendezvous) -> None:
    """Rank place.rank > 0: build the shard, then run every step rank 0 broadcasts until it says stop
    (None) or goes away."""
    from ferrylm.model.parallel.tp import TPGroup

    group = TPGroup(place.host, place.port, place.rank, place.world, agent_store=place.agent_store)
    runner, _, _ = build_runner(config, group)
    while True:
        try:
            output = group.broadcast_object()
        except RuntimeError as e:  # rank 0 exited or died: nothing left to serve
            log.info("tensor-parallel rank %d: rank 0 is gone (%s)", place.rank, str(e).splitlines()[0])
            return
        if output is None:
            return
        if isinstance(output[0], str):  # between steps: ("add_lora", name, path) / ("remove_lora", name)
            command = {"add_lora": runner.add_lora, "remove_lora": runner.remove_lora}[output[0]]
            command(*output[1:])
            continue
        runner.execute(output)  # rank 0's step: the same collectives, nothing sampled here


class SpawnedRanks:
    """Ranks 1..world-1 as child processes of this one (the engine is rank 0): `python -m
    ferrylm.model.parallel.tp_worker`, the config pickled on stdin, so nothing re-runs the caller's __main__."""

    def __init__(self, config: EngineConfig, world: int):
        self.port = _free_port()
        self.procs = []
        for rank in range(1, world):
            proc = subprocess.Popen([sys.executable, "-m", "ferrylm.model.parallel.tp_worker"], stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((config, Rendezvous("127.0.0.1", self.port, rank, world))))
            proc.stdin.close()
            self.procs.append(proc)

    def dead(self) -> str | None:
        """A line naming the first rank that exited, or None while all run."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def join(self, timeout: float = 10.0) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """A spawned rank: read (EngineConfig, Rendezvous) from stdin, serve steps until told to stop."""
    config, place = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{place.rank} %(name)s: %(message)s")
    worker_loop(config, place)


if __name__ == "__main__":
    main()
