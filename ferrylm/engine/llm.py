"""LLM: vLLM-compatible offline batch generation. It has an Engine and drives it to completion."""

from __future__ import annotations

import itertools
import time
from typing import Any

from tqdm import tqdm

from ferrylm.engine.engine import Engine
from ferrylm.engine.parallel_sampling import ParentRequest
from ferrylm.engine_args import engine_config
from ferrylm.lora_request import LoRARequest
from ferrylm.outputs import RequestOutput
from ferrylm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]  # "text" or {"prompt_token_ids": [...]} or {"prompt": "..."}


class LLM:
    """`LLM(model="smollm2-135m").generate(prompts, SamplingParams(...))`, like vLLM's."""

    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto", **kwargs: Any):
        """Keywords are the engine flags' names with underscores, defaults and meaning in config.py
        (`ferrylm serve --help` lists them): e.g. max_num_seqs, quantization, kv_cache_dtype,
        speculative_config (a dict or vLLM's JSON), tensor_parallel_size (ranks 1.. are spawned processes
        until `shutdown()`), swap_space, preemption_mode, num_gpu_blocks_override, enforce_eager, seed.
        An unknown keyword is a TypeError naming it."""
        config = engine_config(model=model, dtype=dtype, **kwargs)
        self.engine = Engine.from_config(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this LLM started, and with a disk tier write the KV pool's
        cached blocks and finish the queued writes (so the next run finds them); call it when done."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list[SamplingParams]
                 | None = None, use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results are returned in prompt order. `lora_request`: one adapter
        for every prompt or one per prompt (None: the base model), as vLLM's (needs enable_lora=True)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        inputs = [self._prompt_input(p) for p in prompts]
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        return self._run(inputs, params_list, use_tqdm, priority, [self._adapter(r) for r in loras])

    def _adapter(self, request: LoRARequest | None) -> str | None:
        """The adapter's name, loading it from its path the first time (or when the path changed)."""
        if request is None:
            return None
        loaded = self.engine.adapters.get(request.lora_name)
        if loaded is None or loaded.path != request.lora_path:
            self.engine.adapters.add(request.lora_name, request.lora_path)
        return request.lora_name

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations: list[list[dict]] = [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[assignment]
        tok = self.engine.tokenizer
        inputs: list[str | list[int]] = [tok.apply_chat_template(c, add_generation_prompt) for c in conversations]
        params = sampling_params or SamplingParams()
        return self._run(inputs, [params] * len(inputs), use_tqdm, None)

    def _prompt_input(self, prompt: PromptType) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]

    def _run(self, inputs: list[str | list[int]], params: list[SamplingParams], use_tqdm: bool,
             priority: list[int] | None, loras: list[str | None] | None = None) -> list[RequestOutput]:
        """One ParentRequest per prompt (n children in the engine), folded back in prompt order."""
        parents: list[ParentRequest] = []
        children: dict[str, tuple[ParentRequest, int]] = {}
        for i, (prompt, p) in enumerate(zip(inputs, params)):
            parent = ParentRequest(str(next(self._ids)), p)
            parents.append(parent)
            for j, (child_id, child_params) in enumerate(parent.children()):
                self.engine.add_request(child_id, prompt, child_params, priority[i] if priority else 0,
                                        output_kind=parent.output_kind, lora_name=loras[i] if loras else None)
                children[child_id] = (parent, j)
        self._drain(children, use_tqdm)
        return [parent.output() for parent in parents]

    def _drain(self, children: dict[str, tuple[ParentRequest, int]], use_tqdm: bool) -> None:
        """Step until idle, handing each child's deltas to its parent."""
        bar = tqdm(total=len(children), desc="Processed prompts", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id not in children:
                    continue  # someone else's request on a shared engine
                parent, j = children[out.request_id]
                parent.add(j, out)
                generated += len(out.outputs[0].token_ids_delta)
                if out.finished:
                    bar.update(1)
            bar.set_postfix_str(f"output {generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s",
                                refresh=False)
        bar.close()
