"""Helpers of bench/anchors.py: peer installation (peers.py), CPU accounting (cpu.py), the engine worker
(worker.py, run by each peer's own Python, so it imports nothing from here)."""
