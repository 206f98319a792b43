"""Expectations from the offline LLM, computed in a worker thread like the server's engine loop.

On a CPU shared with other jobs, the same generate() ran several times slower from the main thread
than from a worker thread (OpenMP under contention), so tests run it where the server does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ferrylm.outputs import RequestOutput
from ferrylm.sampling_params import SamplingParams


def _in_worker(fn, *args, **kwargs):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def flatten(messages: list[dict]) -> list[dict]:
    """Text content parts joined by newlines, as the server does (the offline LLM takes strings)."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in messages]


def chat(llm, conversations: list[list[dict]], **params) -> list[RequestOutput]:
    return _in_worker(llm.chat, [flatten(c) for c in conversations], SamplingParams(**params), use_tqdm=False)


def generate(llm, prompts, **params) -> list[RequestOutput]:
    return _in_worker(llm.generate, prompts, SamplingParams(**params), use_tqdm=False)
