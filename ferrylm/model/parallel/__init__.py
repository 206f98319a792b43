"""Tensor parallelism: shard plans, the process group, spawned ranks and the executor."""
