"""Compiled decode steps (CPU, torch.compile with a disk cache) and CUDA graphs."""
