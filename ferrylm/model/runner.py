"""ModelRunner: owns the weights, the KV cache tensors and sampling state; turns a SchedulerOutput
into a ForwardBatch, runs the model and samples the next token for requests that need one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from ferrylm.config import (
    CacheConfig,
    ConfigError,
    LoRAConfig,
    ModelConfig,
    QuantConfig,
    SpeculativeConfig,
    check_speculative_with_tp,
)
from ferrylm.executor import ModelOutput, PromptLogprob
from ferrylm.model import prompt_logprobs
from ferrylm.model.arch.llama import KVCache, LlamaForCausalLM
from ferrylm.model.attention import AttentionSpec, kv_quant, select_backend
from ferrylm.model.attention.cpu import cpu_fused_ops
from ferrylm.model.compile.compiled_step import CompiledDecodeStep, GraphNotCached
from ferrylm.model.compile.cuda_graphs import CudaGraphRunner
from ferrylm.model.cpu.cpu_threads import configure_cpu_threads
from ferrylm.model.forward_batch import ForwardBatch
from ferrylm.model.kv_disk import KVDiskStore, layout_fingerprint
from ferrylm.model.kv_swap import HostKVSwap
from ferrylm.model.loaders.loader import Checkpoint, load_model
from ferrylm.model.lora.manager import LoRAManager
from ferrylm.model.parallel.tp import ShardedCheckpoint, TPContext, TPGroup
from ferrylm.model.pooling import pool, pooling_rows
from ferrylm.model.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingRequestState,
    greedy_ids,
    plain_greedy,
    token_logprobs,
)
from ferrylm.model.spec import draft_setup
from ferrylm.model.spec.spec_step import Speculator, build_batch, split_rows
from ferrylm.model.structured.reasoning_gate import ReasoningGate
from ferrylm.model.structured.structured_output import apply_grammar_masks, new_matcher
from ferrylm.scheduler_output import SchedulerOutput

log = logging.getLogger("ferrylm.runner")

# A step of at most this many tokens (decodes plus prefill chunks) runs in the compiled decode step, a
# row per token, even with prefill chunks. Past it the graph's LM head over every row (not only the
# sampled ones) outweighs what it saves: 4 decodes + 8 prompt tokens 33.7 ms vs 39.8 eager, + 16 tokens
# 64.9 vs 63.7, + 60 tokens 133.9 vs 118.4 (AVX2 Zen 3, bench/mixed_step.py). Scored chunks (prompt
# logprobs) need every row's logits, and take the graph whenever they fit (1.15x at every size).
MIXED_ROWS_MAX = 12


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
    """Bytes one block takes in every layer's K and V: `dtype` elements for "auto", else 1-byte codes
    plus their scales (int8: a float16 per token and KV head; fp8's per-tensor scale is not per block)."""
    storage = kv_quant.storage_dtype(cache_dtype, dtype)
    codes = block_size * config.num_kv_heads * config.head_dim * storage.itemsize
    scales = kv_quant.scale_bytes_per_block(block_size, config.num_kv_heads, storage)
    return 2 * config.num_layers * (codes + scales)


class ModelRunner:
    """Everything that touches a tensor. Built once; `execute` is called once per engine step.

    `attention`: which backend select_backend picks ("auto" unless a test wants a given one).
    `quantization`: the parsed --quantization (None: the default, see quant.select_quant_method).
    `enforce_eager`: no CUDA graphs (CUDA) and no compiled decode step (CPU, compiled_step.py).
    `compile_in_background`: the CPU decode graphs compile on a thread while steps run eagerly
    (wait_compiled() waits for them); False compiles them here, before the constructor returns.
    `compile_elsewhere`: runs the background compile in another process, filling the disk cache
    (True when it did; compile_worker.py), so the thread here only loads the graphs; None compiles
    on the thread itself, which holds the GIL and slows eager steps meanwhile.
    `int8_activations`: packed weights' decode GEMVs quantize fp32 activations to int8 per 32 values
    (the default for --dtype auto, cpu_plan.py); off, a float32 model is exact against its twin.
    `cache_config.cache_dtype`: "auto" keeps K/V in `dtype`; fp8 / int8 (kv_quant.py) need a backend
    with `supports_quantized_kv` (torch-native, CPU and Triton have it).
    """

    def __init__(self, checkpoint: Checkpoint, cache_config: CacheConfig, dtype: torch.dtype,
                 device: torch.device, max_model_len: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enforce_eager: bool = False, attention: str = "auto",
                 quantization: QuantConfig | None = None, speculative: SpeculativeConfig | None = None,
                 tp: TPGroup | None = None, compile_in_background: bool = True, int8_activations: bool = False,
                 expert_parallel: bool = False, compile_elsewhere: Callable[[], bool] | None = None,
                 lora: LoRAConfig | None = None):
        self.config: ModelConfig = checkpoint.config  # the whole model's (vocabulary, layers, EOS)
        if tp is not None and device.type != "cpu":
            raise ConfigError("--tensor-parallel-size > 1 runs on CPU (gloo) in this version; NCCL on CUDA is not "
                              "built yet")
        self.tp = None if tp is None else TPContext.build(tp, checkpoint.config, expert_parallel)
        self.samples = tp is None or tp.rank == 0  # rank 0 samples; the others only join the collectives
        load_from = checkpoint if self.tp is None else ShardedCheckpoint(checkpoint, self.tp.shard)
        self.local_config: ModelConfig = load_from.config  # this rank's heads and widths (all of them without TP)
        enforce_eager = enforce_eager or self.tp is not None  # collectives are not captured into graphs
        serves_lora = lora is not None and lora.enable_lora
        enforce_eager = enforce_eager or serves_lora  # the compiled step and graphs hold no adapter deltas
        self.device, self.dtype = device, dtype
        # what this process held before this runner (another engine's pool, say): not ours to budget
        self._cuda_held_before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        self.cpu_threads = configure_cpu_threads() if device.type == "cpu" else None
        if self.tp is not None and self.cpu_threads is not None:  # the ranks share this machine's cores
            self.cpu_threads = max(1, self.cpu_threads // self.tp.group.world)
            torch.set_num_threads(self.cpu_threads)
        self.block_size = cache_config.block_size
        self.cache_dtype = cache_config.cache_dtype
        spec = AttentionSpec.for_model(self.local_config, self.block_size, dtype, device)
        self.attn_backend = select_backend(spec, attention)
        if self.cache_dtype != "auto" and not getattr(self.attn_backend, "supports_quantized_kv", False):
            raise ConfigError(f"--kv-cache-dtype {self.cache_dtype} is not supported by the "
                              f"{type(self.attn_backend).__name__} attention backend; use --kv-cache-dtype auto")
        self.model: LlamaForCausalLM = load_model(load_from, dtype, device, self.attn_backend, max_model_len,
                                                   cpu_fused_ops(device), quantization, self.tp, int8_activations)
        self.max_model_len, self.attention_kind = max_model_len, attention
        # an MoE step traces as one graph only where every MoE layer runs the fused op (arch/moe.py): the
        # per-expert loop's groups are data-dependent
        enforce_eager = enforce_eager or not all(b.fused_for(dtype) for b in self.model.moe_blocks())
        self.lora = LoRAManager(self.model, lora, self.config, dtype, device, self.local_config,
                                None if self.tp is None else self.tp.shard) if lora and serves_lora else None
        draft_bytes = draft_setup.kv_bytes_per_block(speculative, self.config, self.block_size, dtype)
        self.num_blocks = cache_config.num_blocks or self._blocks_from_budget(cache_config, max_num_batched_tokens,
                                                                              draft_bytes)
        # One block past the engine's pool (index num_blocks) takes the writes of CUDA-graph (or
        # compiled-step) padding rows.
        self.kv_caches = self._allocate_kv_cache(self.num_blocks + 1)
        # --swap-space: host blocks for swap preemption, each holding a block's target and draft K/V
        self.swap_bytes_per_block = kv_bytes_per_block(self.config, self.block_size, self.dtype,
                                                       self.cache_dtype) + draft_bytes
        # host blocks for swap preemption, then the prefix cache's host tier (--kv-offload-cpu-gib)
        self.num_host_blocks = int((cache_config.swap_space + cache_config.kv_offload_cpu_gib) * (1 << 30)) \
            // self.swap_bytes_per_block
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs: CudaGraphRunner | None = None
        if device.type == "cuda" and self.attn_backend.supports_cuda_graphs and not enforce_eager:
            self.graphs = CudaGraphRunner(self.model, self.kv_caches, max_num_seqs, max_blocks=max_blocks,
                                          pad_block=self.num_blocks, block_size=self.block_size)
            self.graphs.capture()
        # Set once the decode graphs are ready: until then decode steps run eagerly (same tokens).
        self.compiled: CompiledDecodeStep | None = None
        self._compiling: threading.Thread | None = None
        self.compile_elsewhere = compile_elsewhere
        if device.type == "cpu" and hasattr(self.attn_backend, "prepare_decode") and not enforce_eager:
            self._start_compile(max_num_seqs, max_blocks, compile_in_background)
        self.sampler = Sampler()
        self.states: dict[str, SamplingRequestState] = {}
        self.eos_token_ids = list(self.config.eos_token_ids)
        self.vocab_size = self.config.vocab_size
        self.grammar_of: Callable[[str], Any] | None = None  # a grammar reference → its compiled grammar
        self.set_speculative(speculative)
        self.kv_disk = self._disk_store(cache_config, checkpoint, quantization, int8_activations, speculative)

    def _disk_store(self, cache_config: CacheConfig, checkpoint: Checkpoint, quantization: QuantConfig | None,
                    int8_activations: bool, speculative: SpeculativeConfig | None) -> KVDiskStore | None:
        """The disk tier's files (--kv-offload-disk-path), in a directory named by what the blocks'
        bytes depend on; None without the flag."""
        if cache_config.kv_offload_disk_path is None:
            return None
        self._no_tp("The KV disk tier (--kv-offload-disk-path)")
        facts = {"layout": self.kv_layout(), "dtype": str(self.dtype), "quantization": repr(quantization),
                 "int8_activations": int8_activations, "speculative": repr(speculative)}
        fingerprint = layout_fingerprint(checkpoint.source.path, facts, self.kv_swap.device_parts)
        return KVDiskStore(cache_config.kv_offload_disk_path, fingerprint, self.kv_swap.device_parts,
                           self.kv_swap.host_parts)

    def set_speculative(self, speculative: SpeculativeConfig | None) -> None:
        """Propose drafts from the next step on (None: stop). Requests under way keep their sampling
        state; a draft model or layer_skip proposer is built here (a draft model is loaded)."""
        self.speculator = None
        check_speculative_with_tp(speculative, 1 if self.tp is None else self.tp.group.world)
        if speculative is not None:
            proposer = draft_setup.build_proposer(speculative, self.model, self.config, self.num_blocks,
                                                  self.block_size, self.max_model_len, self.dtype, self.device,
                                                  self.attention_kind, self.eos_token_ids)
            self.speculator = Speculator(speculative, self.config.vocab_size, self.eos_token_ids, self.device,
                                         proposer)
        self.kv_swap = HostKVSwap(self._swappable_caches(), self.num_host_blocks)

    def _swappable_caches(self) -> list[torch.Tensor]:
        """Every tensor indexed by the engine's block ids: each layer's K and V, and the draft's."""
        caches = [t for kv in self.kv_caches for t in kv]
        proposer = self.speculator.model_proposer if self.speculator is not None else None
        if proposer is not None:
            caches += [t for kv in proposer.kv_caches for t in kv]
        return caches

    def _swap_blocks(self, output: SchedulerOutput) -> list[int]:
        """Swap preemption's and the prefix tiers' copies, before the forward reuses any freed device
        block: the disk tier's writes gathered first, copies out, disk reads into host blocks, copies
        in. The disk-tier hashes found lost (kv_disk.py)."""
        disk = self.kv_disk
        if disk is not None:
            disk.delete(output.disk.deletes)
            disk.write(output.disk.writes, wait=output.disk.flush)
        self.kv_swap.swap_out(output.blocks_to_swap_out)
        lost = disk.read(output.disk.reads) + disk.take_lost() if disk is not None else []
        self.kv_swap.swap_in(output.blocks_to_swap_in)
        return lost

    def _start_compile(self, max_num_seqs: int, max_blocks: int, background: bool) -> None:
        """Compile (or load from the disk cache) the decode step of every batch-size bucket: on a daemon
        thread by default, so the first request is served eagerly instead of after minutes of
        compiling on a cold cache; the graphs take over from the next step once ready. The thread
        starts at the first step, not here: compiling holds the GIL most of the time, and started
        now it slowed the rest of the start (tokenizer, engine, warm-up) from ~10 s to ~50 s."""
        if not background:
            self.compiled = self._compile_decode(max_num_seqs, max_blocks)
            return
        self._compiling = threading.Thread(target=self._compile_decode, args=(max_num_seqs, max_blocks, True),
                                           name="ferrylm-compile", daemon=True)

    def _start_background_compile(self) -> None:
        if self._compiling is not None and self._compiling.ident is None:
            self._compiling.start()

    def wait_compiled(self, timeout: float | None = None) -> CompiledDecodeStep | None:
        """Block until a background compile has finished (benchmarks, tests); the step or None."""
        if self._compiling is not None:
            self._start_background_compile()
            self._compiling.join(timeout)
        return self.compiled

    def _compile_decode(self, max_num_seqs: int, max_blocks: int, publish: bool = False) -> CompiledDecodeStep | None:
        """The warmed-up compiled step (also stored on self when `publish`); a model that cannot
        compile as one graph stays eager, with a warning. In the background with `compile_elsewhere`,
        graphs missing from the disk cache are compiled by the other process first, then loaded."""
        step = CompiledDecodeStep(self.model, self.kv_caches, max_num_seqs, max_blocks, pad_block=self.num_blocks,
                                  block_size=self.block_size)
        compile_elsewhere = self.compile_elsewhere if publish else None
        elsewhere = compile_elsewhere is not None
        try:
            try:
                report = step.warm_up(compile_missing=compile_elsewhere is None)
            except GraphNotCached:
                assert compile_elsewhere is not None  # only then are missing graphs not compiled here
                if not compile_elsewhere():
                    log.warning("the compile worker failed; compiling the decode graphs in this process")
                    elsewhere = False
                report = step.warm_up()
        except Exception as e:  # noqa: BLE001 - e.g. an op dynamo cannot trace: eager still works
            log.warning("decode step not compiled, running eagerly (--enforce-eager silences this): %s",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        log.info("compiled decode step in %.1f s (batch sizes: %s compiled, %s loaded from %s)", report.seconds,
                 report.compiled, report.loaded, step.cache_dir)
        if elsewhere and report.compiled:
            log.warning("the compile worker's graphs did not match this process's (their keys differ): %s "
                        "compiled again here", report.compiled)
        if publish:
            self.compiled = step
        return step

    def _blocks_from_budget(self, cache_config: CacheConfig, max_num_batched_tokens: int, draft_bytes: int) -> int:
        """KV pool size: `kv_cache_memory` bytes on CPU; on CUDA, as vLLM does, this instance takes
        `gpu_memory_utilization` of the card's memory (an error if that much is not free: another process
        holds it) and the pool is what is left after this process's weights and an activation reserve for
        the largest step; an error too if that cannot hold one max_model_len sequence. A speculative
        draft's K/V (`draft_bytes` per block) shares the budget."""
        per_block = kv_bytes_per_block(self.config, self.block_size, self.dtype, self.cache_dtype) + draft_bytes
        budget = cache_config.kv_cache_memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            ours = torch.cuda.memory_reserved(self.device) - self._cuda_held_before  # this model's weights
            wanted = total * cache_config.gpu_memory_utilization
            gib = 1 << 30
            if free + ours < wanted:
                raise ConfigError(
                    f"--gpu-memory-utilization {cache_config.gpu_memory_utilization} asks for {wanted / gib:.1f} GiB "
                    f"of {self.device}, but only {(free + ours) / gib:.1f} GiB of its {total / gib:.1f} GiB are free "
                    "(other processes hold the rest): lower --gpu-memory-utilization")
            c = self.config
            activations = max_num_batched_tokens * (c.hidden_size * 4 + c.intermediate_size * 3) * 4 \
                + 256 * c.vocab_size * 4  # per-token activations in fp32 + logits of the sampled rows
            budget = int(wanted - ours - activations)
            needed = -(-self.max_model_len // self.block_size)
            if budget // per_block < needed:
                raise ConfigError(
                    f"the KV cache gets {max(budget, 0) / gib:.2f} GiB of {self.device} ({max(budget // per_block, 0)} "
                    f"blocks of {self.block_size} tokens), less than one {self.max_model_len}-token sequence needs "
                    f"({needed} blocks): raise --gpu-memory-utilization or lower --max-model-len")
        return max(1, budget // per_block)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        """Per layer (k_cache, v_cache) of this rank's KV heads; quantized ones carry their scales after
        the codes (kv_quant.py). Every rank has the same number of blocks: the pool is sized from the
        whole model's per-block bytes, the same on every rank."""
        shape = (num_blocks, self.block_size, self.local_config.num_kv_heads, self.local_config.head_dim)
        dtype = kv_quant.storage_dtype(self.cache_dtype, self.dtype)
        return [(kv_quant.allocate(shape, dtype, self.device), kv_quant.allocate(shape, dtype, self.device))
                for _ in range(self.config.num_layers)]

    def kv_layout(self) -> dict:
        """What two engines must share for their KV blocks to be exchangeable (kv_transfer.py)."""
        k = self.kv_caches[0][0]
        return {"model": self.config.name, "layers": self.config.num_layers, "block_size": self.block_size,
                "kv_heads": self.local_config.num_kv_heads, "head_dim": self.local_config.head_dim,
                "storage": str(k.dtype), "cache_dtype": self.cache_dtype, "vocab": self.config.vocab_size}

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, kv_heads, head_dim]: the stored K/V of `block_ids` (a copy)."""
        self._no_tp("KV block transfer")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
                            for k, v in self.kv_caches]).cpu()

    @torch.inference_mode()
    def check_kv_blocks(self, data: Any, num_blocks: int) -> None:
        """ValueError unless `data` is exactly what read_kv_blocks would give for `num_blocks` blocks
        here (a tensor of the cache's storage dtype, every dimension equal) and every value is finite:
        an imported block must not be able to poison a later request's attention."""
        k = self.kv_caches[0][0]
        want = (len(self.kv_caches), 2, num_blocks, *k.shape[1:])
        if not isinstance(data, torch.Tensor) or data.dtype != k.dtype or tuple(data.shape) != want:
            got = (data.dtype, tuple(data.shape)) if isinstance(data, torch.Tensor) else type(data).__name__
            raise ValueError(f"the KV blocks are {got}, not {k.dtype} of shape {want}")
        if data.is_floating_point():
            for layer in data:  # one layer at a time: an fp8 cache is checked in fp32 without a whole copy
                if not bool(torch.isfinite(layer.float()).all()):
                    raise ValueError("the KV blocks hold non-finite values (NaN or infinity)")

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store `data` (read_kv_blocks' shape, one entry per block id) into those blocks."""
        self._no_tp("KV block transfer")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, data[layer, 0].to(k.device, k.dtype))
            v.index_copy_(0, idx, data[layer, 1].to(v.device, v.dtype))

    def _no_tp(self, what: str) -> None:
        if self.tp is not None:
            raise ConfigError(f"{what} is not supported with --tensor-parallel-size > 1")

    def use_grammars(self, compiled: Callable[[str], Any] | None) -> None:
        """Where a SchedulerOutput's grammar references resolve (the engine's GrammarCompiler.compiled)."""
        self.grammar_of = compiled

    def dead(self) -> str | None:
        """Nothing of a runner runs apart from it (spawned ranks: parallel_executor.py)."""
        return None

    def shutdown(self) -> None:
        """Finish the disk tier's queued writes (a tensor-parallel group's ranks are stopped by its executor)."""
        if self.kv_disk is not None:
            self.kv_disk.close()
            self.kv_disk = None

    def kv_disk_entries(self) -> list[tuple[int, int]]:
        """(block hash, owner) of the disk tier's files at start, oldest first (none without one)."""
        return self.kv_disk.entries() if self.kv_disk is not None else []

    def kv_disk_stats(self) -> dict[str, float]:
        disk = self.kv_disk
        if disk is None:
            return {"bytes_written": 0, "bytes_read": 0, "read_seconds": 0.0}
        return {"bytes_written": disk.bytes_written, "bytes_read": disk.bytes_read, "read_seconds": disk.read_seconds}

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelOutput:
        """One step, run alike by every tensor-parallel rank on the same `output` (the executor hands
        it over): each choice of forward reads only `output` and the states every rank keeps, so all
        ranks call the collectives in the same order. Only rank 0 samples, verifies and proposes; the
        others return an empty ModelOutput."""
        self._start_background_compile()
        lost = self._swap_blocks(output)
        result = self._execute(output)
        return result._replace(kv_disk_lost=tuple(lost)) if lost else result

    def _execute(self, output: SchedulerOutput) -> ModelOutput:
        self._update_states(output)
        if not output.scheduled:
            return ModelOutput({}, {})
        with self._adapter_rows(output):
            logits, scored, pooled = self._run_model(output)
        if not self.samples:
            return ModelOutput({}, {})
        rows = [i for i, s in enumerate(output.scheduled) if s.sample]
        if not rows:
            return ModelOutput({}, {}, scored, pooled=pooled)
        counts = [1 + len(output.scheduled[i].draft_token_ids) for i in rows]
        if len(counts) == sum(counts):
            result = self._sample(logits, [output.scheduled[i].request_id for i in rows])
        else:
            result = self._sample_and_verify(logits, [output.scheduled[i] for i in rows], counts)
        drafts = {}
        if self.speculator is not None:
            drafts = self.speculator.propose([output.scheduled[i] for i in rows], self.states)
        return result._replace(prompt_logprobs=scored, draft_token_ids=drafts, pooled=pooled)

    def add_lora(self, name: str, path: str) -> int:
        if self.lora is None:
            raise ConfigError("LoRA adapters need --enable-lora")
        return self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        if self.lora is not None:
            self.lora.remove(name)

    def _update_states(self, output: SchedulerOutput) -> None:
        """Forget finished requests, restart preempted ones, start new ones. A grammar is compiled only
        where tokens are sampled (rank 0): the other ranks keep each request's params and prompt."""
        for rid in output.finished_ids:
            self.states.pop(rid, None)
            if self.speculator is not None:
                self.speculator.forget(rid)
        for rid in output.preempted_ids:
            if self.speculator is not None:
                self.speculator.lost_blocks(rid)
            if rid in self.states:  # recomputed from its first token: a pooled sum restarts
                self.states[rid].pool, self.states[rid].pooled_rows = None, 0
        for new in output.new_requests:
            if self.speculator is not None:
                self.speculator.forget(new.request_id)
            grammar = None
            if new.grammar is not None and self.samples:
                grammar = new_matcher(self._compiled_grammar(new.grammar))
                constraint = new.sampling_params.structured_outputs
                if constraint is not None and constraint.reasoning_end:  # the answer only, not the thinking
                    grammar = ReasoningGate(grammar, constraint.reasoning_end, constraint.reasoning_start)
            self.states[new.request_id] = SamplingRequestState(new.sampling_params, new.prompt_token_ids,
                                                                grammar=grammar)
        if self.lora is not None:
            self.lora.track(output)

    def _adapter_rows(self, output: SchedulerOutput) -> AbstractContextManager[None]:
        """While the model runs, each scheduled request's rows get its LoRA adapter's deltas (its
        tokens are consecutive rows: with adapters nothing is compiled, so no row-per-token layout)."""
        if self.lora is None:
            return nullcontext()
        return self.lora.rows([s.request_id for s in output.scheduled], [len(s.token_ids) for s in output.scheduled],
                              self.device)

    def _run_model(self, output: SchedulerOutput
                   ) -> tuple[torch.Tensor, dict[str, list[PromptLogprob]], dict[str, list[float]]]:
        """The sampled rows' logits, the scored prompt tokens and the pooled vectors of this step: the
        forward and every logits collective, the same on every rank (under tensor parallelism nothing
        is compiled, so no rank switches to a graph at a moment of its own)."""
        batch = build_batch(output.scheduled, self.block_size, self.device, self._rows_fit_compiled(output))
        plans = prompt_logprobs.plan(output.scheduled, self.states)
        pooling = pooling_rows(output.scheduled, self.states)
        if plans and not pooling and self.compiled is not None and self.compiled.can_run(batch):
            every = self.compiled.logits(batch)  # one row per token: the scored rows' logits are here
            scored = prompt_logprobs.compute(lambda rows: rows, every, plans)
            return every.index_select(0, batch.logits_indices), scored, {}
        if not plans and not pooling:
            return self._logits(batch, len(batch.logits_indices)), {}, {}
        # eager: the prompt rows' hidden states are needed, not only the sampled rows'
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        scored = prompt_logprobs.compute(self.model.compute_logits, hidden, plans) if plans else {}
        return logits, scored, pool(hidden, pooling, self.states)

    def _rows_fit_compiled(self, output: SchedulerOutput) -> bool:
        """Whether to lay this step's prefill chunks out as decode rows and run the compiled step: when
        its tokens fit the graphs and either few (the graph then beats the eager mixed step) or every
        row's logits are needed anyway (prompt logprobs)."""
        if self.compiled is None:
            return False
        tokens = sum(len(s.token_ids) for s in output.scheduled)
        if tokens > self.compiled.max_num_seqs:
            return False
        return tokens <= MIXED_ROWS_MAX or any(self.states[s.request_id].params.prompt_logprobs is not None
                                               for s in output.scheduled if len(s.token_ids) > 1)

    def _compiled_grammar(self, ref: str) -> Any:
        if self.grammar_of is None:
            raise RuntimeError("a structured-output request reached a runner without a grammar compiler")
        return self.grammar_of(ref)

    def _sample_and_verify(self, logits: torch.Tensor, items: list, counts: list[int]) -> ModelOutput:
        """Rows without a draft are sampled as usual; drafted rows are verified (spec_step.py)."""
        assert self.speculator is not None
        plain, drafted, plain_rows, drafted_rows = split_rows(counts)
        result = ModelOutput({}, {})
        if plain:
            result = self._sample(logits.index_select(0, plain_rows.to(logits.device)),
                                  [items[i].request_id for i in plain])
        verified = self.speculator.verify(logits.index_select(0, drafted_rows.to(logits.device)),
                                          [items[i] for i in drafted], self.states)
        return ModelOutput(result.sampled | verified.sampled, result.logprobs | verified.logprobs,
                            accepted=verified.accepted, accepted_logprobs=verified.accepted_logprobs)

    def _logits(self, batch: ForwardBatch, num_sampled: int) -> torch.Tensor:
        """float32 logits of the rows in batch.logits_indices (a compiled step computes every row's
        and keeps those; with no sampled rows the forward still runs, for its K/V writes)."""
        if self.compiled is not None and self.compiled.can_run(batch):
            logits = self.compiled.logits(batch)
            return logits if num_sampled == batch.num_seqs else logits.index_select(0, batch.logits_indices)
        hidden = self._forward(batch)
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states: a graph replay for a decode batch that fits (each graph holds the metadata
        prepared from its static inputs at capture), else the model with this step's attention
        metadata, prepared here once for all layers."""
        if self.graphs is not None and self.graphs.can_replay(batch):
            return self.graphs.replay(batch)
        return self.model(batch.with_attn_metadata(self.attn_backend.prepare(batch)), self.kv_caches)

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> ModelOutput:
        states = [self.states[rid] for rid in request_ids]
        guided = [i for i, state in enumerate(states) if state.grammar is not None]
        if guided:  # structured output: only the tokens each row's grammar allows next
            for row in apply_grammar_masks(logits, guided, [states[i].grammar for i in guided]):
                # a dead end: nothing may follow, so the request ends here (EOS: finish_reason "stop")
                # instead of sampling from all -inf and breaking its constraint until max_tokens
                logits[row, self.eos_token_ids] = 0.0
        if plain_greedy(states):
            result = SamplerOutput(greedy_ids(logits), None, None, None)
        else:
            result = self.sampler(logits, SamplingBatch.build(states, self.config.vocab_size, self.eos_token_ids,
                                                              self.device))
        tokens = result.token_ids.tolist()
        sampled, logprobs = {}, {}
        for rid, state, token in zip(request_ids, states, tokens):
            state.output_token_ids.append(token)
            sampled[rid] = token
            if state.grammar is not None and not state.grammar.accept_token(token):
                log.warning("request %s: token %d rejected by its grammar", rid, token)
        if result.logprobs is not None:
            for rid, entry in zip(request_ids, token_logprobs(result, [st.params.logprobs for st in states])):
                if entry is not None:
                    logprobs[rid] = entry
        return ModelOutput(sampled, logprobs)
