"""One engine in its own process: load the model once, then run the timed requests the parent sends.

Run by each engine's own venv Python (FerryLM's, vLLM's, llama.cpp's), so it imports only the standard
library and that engine. Protocol: one JSON object per line on stdin ({"op": "stream" | "batch" |
"ttft", "prompts": [[token ids]], "max_tokens": [int]} or {"op": "quit"}), one JSON reply per line
on stdout; the engines' own logging goes to stderr (stdout is re-pointed there so a stray print can't
corrupt the channel).

    python bench/anchors/worker.py --engine ferrylm|vllm|llamacpp --model PATH [--quantization Q]
    python bench/anchors/worker.py --engine llamaserver --model GGUF --server PATH/llama-server

llamaserver / llamaserver-avx2 (bench/anchors/llama_server.py) run llama.cpp's llama-server, which decodes
many sequences in parallel; the worker drives it over loopback HTTP, from FerryLM's venv Python.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parents[2]
REQUEST_IDS = itertools.count()


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        """Greedy, ignore_eos; all prompts submitted at once; returns output tokens produced."""

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """One request; its token ids and the perf_counter time each one arrived."""

    def reset_cache(self) -> None:
        """Forget cached prefixes so a repeated TTFT measurement prefills in full."""


class FerryLMEngine:
    def __init__(self, model: str, quantization: str, extra_buffers: bool = True, kv_cache_dtype: str = "auto"):
        sys.path.insert(0, str(ROOT))
        from ferrylm import LLM, SamplingParams

        # Trees from M2.3 on take quantization= (unset there: a GGUF stays packed, so "none" is passed
        # explicitly); older ones are unquantized and take no such argument.
        kwargs = {"quantization": quantization} if "quantization" in inspect.signature(LLM).parameters else {}
        if not kwargs and quantization != "none":
            raise ValueError(f"this FerryLM tree's LLM takes no quantization= (asked for {quantization!r})")
        if kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = kv_cache_dtype
        self.llm = LLM(model, dtype="auto", max_num_seqs=64, max_num_batched_tokens=1024, seed=0, **kwargs)
        runner = self.llm.engine.executor
        if hasattr(runner, "wait_compiled"):  # trees from M3.1 on compile in the background: time the graphs
            runner.wait_compiled()
        self.params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        self.info = {"dtype": str(runner.dtype), "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
                     "kernels": os.environ.get("FERRYLM_CPU_ISA", "auto"),
                     "compiled": getattr(runner, "compiled", None) is not None}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], [self.params(n) for n in max_tokens],
                                 use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        engine = self.llm.engine
        engine.add_request(f"stream-{next(REQUEST_IDS)}", prompt, self.params(max_tokens))
        return _drain_steps(engine.step, engine.has_unfinished_requests)

    def reset_cache(self) -> None:
        self.llm.engine.block_manager.reset_prefix_cache()


class VLLMEngine:
    def __init__(self, model: str, quantization: str, extra_buffers: bool = True):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = LLM(model=model, dtype="bfloat16", seed=0, max_num_seqs=64, max_model_len=2048)
        self.prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)
        self.params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=0)
        import vllm

        self.info = {"dtype": "bfloat16", "version": vllm.__version__}

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        outs = self.llm.generate([self.prompt(p) for p in prompts], [self.params(n) for n in max_tokens],
                                 use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        engine = self.llm.llm_engine  # LLM.generate() returns only at the end; stepping shows each token
        engine.add_request(f"stream-{next(REQUEST_IDS)}", self.prompt(prompt), self.params(max_tokens))
        return _drain_steps(engine.step, engine.has_unfinished_requests)

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()


class LlamaCppEngine:
    """llama-cpp-python's Llama holds one sequence: batches run one request after another."""

    def __init__(self, model: str, quantization: str, extra_buffers: bool = True):
        import llama_cpp
        import llama_cpp.llama_cpp as lib

        if not extra_buffers:  # Llama() has no switch for it: its default model params get one
            default = lib.llama_model_default_params

            def without_extra_buffers():
                params = default()
                params.use_extra_bufts = False
                return params

            lib.llama_model_default_params = without_extra_buffers
        threads = os.cpu_count() or 1
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, seed=0, verbose=False)
        self.info = {"dtype": "GGUF Q4_1 (as shipped)", "version": llama_cpp.__version__, "threads": threads,
                     "extra_buffers": extra_buffers}

    def _tokens(self, prompt: list[int], max_tokens: int):
        self.llm.reset()  # else generate() reuses the previous request's matching prefix
        for i, token in enumerate(self.llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True)):
            yield token  # generate() never stops at EOS by itself: ignore_eos as the others
            if i + 1 >= max_tokens:
                return

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        return sum(sum(1 for _ in self._tokens(p, n)) for p, n in zip(prompts, max_tokens))

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        ids, times = [], []
        for token in self._tokens(prompt, max_tokens):
            ids.append(int(token))
            times.append(time.perf_counter())
        return ids, times

    def reset_cache(self) -> None:
        self.llm.reset()


def _drain_steps(step, unfinished) -> tuple[list[int], list[float]]:
    """Step an engine holding one cumulative-output request until it is done, timing each new token."""
    ids: list[int] = []
    times: list[float] = []
    while unfinished():
        for out in step():
            new = list(out.outputs[0].token_ids)[len(ids):]
            ids += new
            times += [time.perf_counter()] * len(new)
    return ids, times


def _llama_server(model: str, quantization: str, extra_buffers: bool = True, server: str | None = None):
    from llama_server import LlamaServerEngine  # bench/anchors/ (this script's folder) is on sys.path

    return LlamaServerEngine(model, quantization, extra_buffers, server=server)


ENGINES = {"ferrylm": FerryLMEngine, "vllm": VLLMEngine, "llamacpp": LlamaCppEngine,
           "llamaserver": _llama_server, "llamaserver-avx2": _llama_server}


def run(engine: Engine, req: dict) -> dict:
    """Time one request from the parent; every figure is measured here, next to the engine."""
    prompts, max_tokens = req["prompts"], req["max_tokens"]
    if req["op"] == "stream":
        start = time.perf_counter()
        ids, times = engine.stream(prompts[0], max_tokens[0])
        decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return {"value": decode, "tokens": len(ids), "ttft": times[0] - start, "ids": ids}
    if req["op"] == "batch":
        start = time.perf_counter()
        n = engine.generate(prompts, max_tokens)
        seconds = time.perf_counter() - start
        return {"value": n / seconds, "tokens": n, "seconds": seconds}
    if req["op"] == "ttft":
        samples = []
        for p in prompts:
            engine.reset_cache()
            start = time.perf_counter()
            engine.generate([p], [1])
            samples.append(time.perf_counter() - start)
        return {"value": statistics.median(samples), "samples": samples, "tokens": len(samples)}
    raise ValueError(f"unknown op {req['op']!r}")


def warm_up(engine: Engine) -> None:
    """First calls compile kernels or size buffers in every engine; keep that out of the timings."""
    synthetic = [[1000 + (i * 7 + j) % 20000 for j in range(n)] for i, n in enumerate([16, 64, 300, 500])]
    engine.stream(synthetic[0], 8)
    engine.generate(synthetic, [8] * len(synthetic))
    engine.reset_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=sorted(ENGINES), required=True)
    p.add_argument("--model", required=True, help="ferrylm: its model name; vllm: HF folder; llamacpp: GGUF")
    p.add_argument("--quantization", default="none", help="ferrylm only: LLM(quantization=...)")
    p.add_argument("--no-extra-buffers", action="store_true", help="llamacpp only: no AMX / repacked weights")
    p.add_argument("--kv-cache-dtype", default="auto", help="ferrylm only: LLM(kv_cache_dtype=...)")
    p.add_argument("--server", help="llamaserver*: the llama-server binary")
    args = p.parse_args()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")

    start = time.perf_counter()
    extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.engine == "ferrylm" else {}
    if args.engine.startswith("llamaserver"):
        extra = {"server": args.server}
    engine = ENGINES[args.engine](args.model, args.quantization, not args.no_extra_buffers, **extra)
    load_s = time.perf_counter() - start
    warm_up(engine)
    reply({"ready": True, "load_s": load_s, "warm_s": time.perf_counter() - start - load_s, "info": engine.info})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            reply(run(engine, req))
        except Exception:  # report, keep serving: the parent decides whether to go on
            reply({"error": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
