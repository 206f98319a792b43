"""Correctness checks that need a GPU, shared by test_cuda.py and bench/gpu.py (which runs them first).

Each returns a JSON-able dict with "passed", so the benchmark can report a failure and carry on.
"""

from __future__ import annotations

import random

import torch

from tests.gpu.interpreter_cases import run_case
from tests.gpu.random_model import build_engine, build_runner, generate_greedy, model_config

SHAPES = {"smollm2": (9, 3, 64), "llama3": (32, 8, 128)}  # heads, KV heads, head dim
BATCHES = {  # query lens, context lens, forced decode partitions (None: the backend's choice), window
    "prefill_fresh": ([1000, 37, 16], [0, 0, 0], None, None),
    "prefill_prefix_hit": ([300, 5], [512, 4000], None, None),
    "mixed": ([1, 200, 1, 1], [3000, 48, 0, 15], None, None),
    "mixed_forced_split_5": ([1, 64, 1], [2000, 100, 7], 5, None),
    "decode_auto_split": ([1] * 5, [1, 16, 17, 900, 5000], None, None),
    "decode_forced_split_7": ([1] * 3, [2, 1500, 8191], 7, None),
    # sliding-window layers (Gemma 3 uses 512 and 1024)
    "window_prefill_fresh": ([1000, 37, 16], [0, 0, 0], None, 512),
    "window_prefill_prefix_hit": ([300, 5], [512, 4000], None, 1024),
    "window_mixed": ([1, 200, 1, 1], [3000, 48, 0, 15], None, 512),
    "window_decode_auto_split": ([1] * 5, [1, 16, 17, 900, 5000], None, 512),
    "window_decode_forced_split_7": ([1] * 3, [2, 1500, 8191], 7, 1000),
}


def kernel_errors(dtype: torch.dtype = torch.bfloat16, tol: float = 1e-2, block_size: int = 16) -> dict:
    """TritonBackend vs TorchNativeBackend on CUDA for every shape x batch: relative error or FAIL."""
    errors: dict[str, float | str] = {}
    for shape, (heads, kv_heads, head_dim) in SHAPES.items():
        for name, (query_lens, context_lens, parts, window) in BATCHES.items():
            try:
                errors[f"{shape}/{name}"] = run_case(heads, kv_heads, head_dim, block_size, query_lens, context_lens,
                                                     parts, window, device="cuda", dtype=dtype, tol=tol)
            except AssertionError as e:
                errors[f"{shape}/{name}"] = f"FAIL {e}"
    return {"passed": all(isinstance(v, float) for v in errors.values()), "rel_err": errors}


def greedy_parity(name: str = "smollm2-135m", prompt_lens: tuple[int, ...] = (5, 50, 200, 17),
                  max_tokens: int = 16) -> dict:
    """Greedy float32 outputs through the Engine: CPU torch-native vs GPU Triton with CUDA graphs."""
    config = model_config(name, 1024)
    rng = random.Random(1)
    prompts = [[rng.randrange(5, config.vocab_size) for _ in range(n)] for n in prompt_lens]
    outputs = {}
    for device, attention, graphs in (("cpu", "torch", False), ("cuda", "triton", True)):
        runner = build_runner(config, device=device, dtype=torch.float32, num_blocks=128, max_model_len=1024,
                              attention=attention, cuda_graphs=graphs, max_num_seqs=8, weights_device="cpu")
        engine = build_engine(runner, 128, 1024, max_num_seqs=8, max_num_batched_tokens=64)
        outputs[device] = generate_greedy(engine, prompts, max_tokens)
    first_mismatch = [next((i for i, (a, b) in enumerate(zip(c, g)) if a != b), None)
                      for c, g in zip(outputs["cpu"], outputs["cuda"])]
    return {"passed": outputs["cpu"] == outputs["cuda"], "first_mismatch_per_prompt": first_mismatch,
            "tokens_compared": sum(map(len, outputs["cpu"]))}
