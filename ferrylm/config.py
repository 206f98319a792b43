"""Frozen configuration objects, one per layer; `resolve` helpers return new objects, never mutate."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """A configuration value a user gave is invalid."""


def option(default: Any, help: str, *, name: str | None = None, choices: tuple[str, ...] | None = None,
           parse: Callable[[Any], Any] | None = None, short: str | None = None, env: str | None = None,
           nargs: str | None = None, metavar: str | None = None) -> Any:
    """A config field that is also a command-line flag (config_flags.py generates it; the engine's are
    `LLM()` keywords too): its default and help text live here only. `name`: the flag/keyword when it
    differs from the field's (vLLM's spelling); `parse`: the flag's text to the field's value (with
    `nargs`, the list of texts, converted when the config is built); `env`: a variable whose value, when
    set, is the flag's default (for secrets kept off the command line)."""
    return field(default=default, metadata={"help": help, "name": name, "choices": choices, "parse": parse,
                                             "short": short, "env": env, "nargs": nargs, "metavar": metavar})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family transformer, read from config.json or GGUF metadata."""

    # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" | "mixtral" | "qwen3_moe" | "llama4" | "gemma3"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, object], ...] | None = None  # dict items, hashable
    # a GGUF file's rope_freqs tensor (llama.cpp's converter writes Llama 3.1+ scaling this way): each
    # rotary frequency is divided by its factor
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (head_dim wide) before RoPE
    rotary_dim: int | None = None  # dims of a head that RoPE rotates (Phi's partial_rotary_factor); None: all
    # mixture of experts (arch/moe.py): 0 experts is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the chosen experts' router probabilities
    moe_layers: tuple[int, ...] | None = None  # layers whose MLP is sparse; None: all (when num_experts)
    # "softmax": top-k of the router's probabilities weights each expert's output (Mixtral, Qwen);
    # "sigmoid": the sigmoid of each chosen expert's logit scales its input (Llama 4)
    moe_router: str = "softmax"
    shared_expert_intermediate_size: int = 0  # an expert every token goes through besides its routed ones
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (Llama 4)
    qk_l2_norm: bool = False  # Llama 4: q and k RMS-normalised (no weight) after RoPE, on RoPE layers
    # sliding-window attention (Gemma 3): layer i in sliding_layers attends to its last sliding_window
    # positions, its own included (q_pos - k_pos < sliding_window), with local_rope_theta; the other
    # layers attend fully. A None window leaves the sliding layers unmasked (their RoPE still local).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (unscaled); None: rope_theta
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    final_logit_softcapping: float | None = None  # logits <- cap * tanh(logits / cap)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh"
    prequantized: str | None = None  # PREQUANTIZED_METHODS: the checkpoint's Linears are int4 (quantization_config)
    local_experts: tuple[int, ...] | None = None  # expert parallelism: the experts this rank holds; None: all
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index`, or None when it attends to its whole context."""
        return self.sliding_window if index in self.sliding_layers else None

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and (self.moe_layers is None or index in self.moe_layers)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None


# --kv-cache-dtype, vLLM's values plus int8: "auto" stores K/V in the model's dtype; "fp8" is e4m3.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, pool size (explicit or from a memory budget), prefix caching, and
    the dtype K/V are stored in (`cache_dtype`, --kv-cache-dtype: 1-byte fp8 / int8 codes hold twice
    the tokens of bf16 in the same kv_cache_memory; model/attention/kv_quant.py has the layout)."""

    block_size: int = option(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = option(None, "the KV pool's size in blocks, whatever the memory budget and the dtype "
                                          "(vLLM's flag; on the CPU too): the same pool on every machine",
                                    name="num_gpu_blocks_override")
    kv_cache_memory: int = option(1 << 30, "bytes for the KV pool (CPU); unused with --num-gpu-blocks-override")
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights, activations and the KV "
                                                "pool (CUDA)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a prompt prefix seen before (per cache "
                                               "salt: tenants never share)")
    cache_dtype: str = option("auto", "K/V storage: auto (the model's dtype), fp8 (= fp8_e4m3, per-tensor "
                                      "scale), fp8_e5m2, int8 (a scale per token and KV head); 1-byte codes "
                                      "hold twice the tokens", name="kv_cache_dtype", choices=KV_CACHE_DTYPE_CHOICES)
    swap_space: float = option(4.0, "GiB of host memory for KV blocks of requests preempted by swap (0: no swap)")
    kv_offload_cpu_gib: float = option(
        0.0, "GiB of host memory under the prefix cache: cached blocks evicted from the KV pool are kept there "
             "and loaded back when a prompt needs them again (agent turns after a tool call; 0: off)")
    kv_offload_disk_path: str | None = option(
        None, "a directory for the prefix cache's disk tier under --kv-offload-cpu-gib: blocks leaving the KV "
              "pool are also written there and read back through host memory, across restarts of the same "
              "model (files are checked on read; one server per directory)")
    kv_offload_disk_gib: float = option(16.0, "GiB of files the disk tier keeps (the least recently used go first)")

    def __post_init__(self) -> None:
        if not self.swap_space >= 0:
            raise ConfigError(f"--swap-space must be >= 0 GiB, not {self.swap_space!r}")
        if not self.kv_offload_cpu_gib >= 0:
            raise ConfigError(f"--kv-offload-cpu-gib must be >= 0 GiB, not {self.kv_offload_cpu_gib!r}")
        if not self.kv_offload_disk_gib > 0:
            raise ConfigError(f"--kv-offload-disk-gib must be > 0 GiB, not {self.kv_offload_disk_gib!r}")
        if self.kv_offload_disk_path is not None and not (self.kv_offload_cpu_gib > 0 and self.enable_prefix_caching):
            raise ConfigError("--kv-offload-disk-path reads blocks back through the host tier: it needs "
                              "--kv-offload-cpu-gib > 0 and prefix caching on")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 1 block, not {self.num_blocks}")
        if self.cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ConfigError(f"--kv-cache-dtype {self.cache_dtype!r} is not supported; choose one of "
                              f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")


PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the iteration-level scheduler (vLLM names)."""

    max_num_seqs: int = option(64, "requests running at once (one batch row each)")
    max_num_batched_tokens: int = option(512, "tokens one step may hold: decodes plus prompt chunks")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's context)")
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = option(
        0, "at most this many prompt tokens of one request per step (0: no cap): smaller chunks keep other "
           "requests' inter-token latency lower while a long prompt is prefilled, its own TTFT higher")
    preemption_mode: str = option(
        "auto", "a request preempted for KV blocks: recompute (re-prefill it later), swap (copy its blocks to "
                "host memory and back, --swap-space), auto (per request, whichever engine/preemption.py's cost "
                "model says is cheaper)", choices=PREEMPTION_MODES)
    decode_isolation_headroom: float = option(
        0.0, "while one tenant's requests decode, another tenant's prompt tokens may lengthen a step by at most "
             "this fraction of its decode-only time (engine/step_cost.py learns a token's cost; at least 1 token "
             "a step; 0: off; tenants are told apart by cache salt, which both front doors set per tenant)")

    def __post_init__(self) -> None:
        if not 0 <= self.decode_isolation_headroom <= 100:
            raise ConfigError("--decode-isolation-headroom must be between 0 (off) and 100")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be 0 (off) or positive")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode {self.preemption_mode!r} is not supported; choose one of "
                              f"{', '.join(PREEMPTION_MODES)}")


@dataclass(frozen=True)
class LoRAConfig:
    """Adapters in peft's format served beside the base model, chosen per request (model/lora/)."""

    enable_lora: bool = option(False, "serve LoRA adapters (peft format) on the base model, chosen per request "
                                      "by its model name (vLLM's flag)")
    max_loras: int = option(1, "adapters one step may use at once (vLLM's default 1: requests of another adapter "
                               "wait until the running adapter's requests finish)")
    max_lora_rank: int = option(16, "the largest adapter rank accepted (a larger one is refused at load)")
    max_cpu_loras: int | None = option(None, "adapters kept unpacked in host memory (default: --max-loras); "
                                             "others are read again from their files when a request needs them")

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("--max-loras and --max-lora-rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError("--max-cpu-loras must be >= --max-loras")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


PREQUANTIZED_METHODS = ("awq", "gptq", "compressed-tensors")  # a checkpoint's own int4 format (quantization_config)
QUANTIZATION_CHOICES = ("none", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256", "gguf", "fp8",
                        *PREQUANTIZED_METHODS)


@dataclass(frozen=True)
class QuantConfig:
    """A parsed --quantization value. method: "none" | "int8" | "int4" | "gguf" | "fp8" | "awq" | "gptq" |
    "compressed-tensors"; group_size
    for int4 (inputs per scale and min; plain "int4" means 32, llama.cpp's Q4 block)."""

    method: str
    group_size: int | None = None

    @classmethod
    def parse(cls, value: str) -> "QuantConfig":
        if value not in QUANTIZATION_CHOICES:
            raise ConfigError(f"--quantization {value!r} is not supported; choose one of "
                              f"{', '.join(QUANTIZATION_CHOICES)} (or leave it unset: GGUF files stay packed, "
                              "other checkpoints unquantized)")
        if value.startswith("int4"):
            return cls("int4", int(value.removeprefix("int4-g") or 32) if "-g" in value else 32)
        return cls(value)


SPECULATIVE_METHODS = ("ngram", "draft_model", "layer_skip")
SPECULATIVE_PLANNED = ("eagle", "eagle3", "medusa", "mtp")  # vLLM's, not built here yet
# Keys that only some methods read: given to another method, they would be silently ignored.
_METHOD_KEYS = {"prompt_lookup_min": "ngram", "prompt_lookup_max": "ngram", "model": "draft_model",
                "num_layers": "layer_skip"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config (vLLM's JSON): how drafts are proposed and how many per step.

    ngram: prompt lookup, the last prompt_lookup_max..prompt_lookup_min tokens matched earlier in the
    request's own tokens. draft_model: `model` (an alias, a .gguf file or a HF directory) with the
    target's vocabulary drafts autoregressively with its own paged KV cache. layer_skip: the target's
    first `num_layers` layers plus its norm and LM head draft (no second set of weights).
    disable_by_batch_size: no drafts in a step with more running sequences than this (verification
    then costs more than it saves; bench/speculative.py measures it). None: the machine's default
    (spec_step.max_spec_batch: 8 with AMX or a GPU, 1 on other CPUs).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model
    num_layers: int | None = None  # layer_skip

    def __post_init__(self) -> None:
        if self.method in SPECULATIVE_PLANNED:
            raise ConfigError(f"--speculative-config method {self.method!r} is not implemented in this version; "
                              f"supported: {', '.join(SPECULATIVE_METHODS)}")
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config method {self.method!r} is unknown; supported: "
                              f"{', '.join(SPECULATIVE_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ConfigError("--speculative-config num_speculative_tokens must be an integer >= 1, "
                              f"not {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max "
                              f"(got {self.prompt_lookup_min}, {self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError("--speculative-config disable_by_batch_size must be >= 1")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ConfigError("--speculative-config method 'draft_model' needs 'model': the draft model's "
                              "alias, .gguf file or Hugging Face directory")
        if self.method == "layer_skip" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ConfigError("--speculative-config method 'layer_skip' needs 'num_layers', an integer >= 1 "
                              f"(the target's first layers that draft), not {self.num_layers!r}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the flag's JSON text or LLM(speculative_config=dict); unknown keys are an error."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        if value.get("method") in SPECULATIVE_PLANNED:  # before its own keys (draft_model's "model") are judged
            raise ConfigError(f"--speculative-config method {value['method']!r} is not implemented in this "
                              f"version; supported: {', '.join(SPECULATIVE_METHODS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"--speculative-config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ConfigError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        stray = sorted(k for k, method in _METHOD_KEYS.items() if k in value and value["method"] != method)
        if stray and value["method"] in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative-config keys {stray} do not apply to method {value['method']!r}")
        return cls(**value)


def check_speculative_with_tp(speculative: SpeculativeConfig | None, tensor_parallel_size: int) -> None:
    """The model-based proposers draft on the target's shard-local model: only ngram runs under TP."""
    if tensor_parallel_size > 1 and speculative is not None and speculative.method != "ngram":
        raise ConfigError(f"--speculative-config method {speculative.method!r} with --tensor-parallel-size > 1 "
                          "is not supported (ngram is)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs: which model, its dtype/device, the cache and the scheduler."""

    model: str = option("smollm2-135m", "alias, .gguf file or Hugging Face model directory")
    dtype: str = option("auto", "weights' and activations' dtype", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = option("cpu", "cpu, cuda or cuda:N")
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    quantization: str | None = option(
        None, "weights kept quantized at run time: int8 / int4[-gN] (quantized at load), gguf (a GGUF file's "
              "blocks kept packed), fp8 (CUDA), awq / gptq / compressed-tensors (a pre-quantized checkpoint), none; "
              "default: GGUF packed on CPU, a checkpoint's quantization_config, else none",
        choices=QUANTIZATION_CHOICES)
    enforce_eager: bool = option(False, "run every step eagerly: no compiled decode step (CPU; compiled at "
                                        "start-up, cached under $FERRYLM_CACHE_DIR) and no CUDA graphs")
    speculative: SpeculativeConfig | None = option(
        None, 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4}\' (prompt_lookup_min, disable_by_batch_size optional); "draft_model" '
              'with "model" (same vocabulary); "layer_skip" with "num_layers"',
        name="speculative_config", parse=lambda text: SpeculativeConfig.parse(text))
    tensor_parallel_size: int = option(
        1, "ranks holding a shard of every layer (torch.distributed; ranks 1.. are spawned here, or joined "
           "from torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)", short="-tp")
    enable_expert_parallel: bool = option(
        False, "mixture-of-experts models under --tensor-parallel-size: place whole experts on the ranks "
               "instead of splitting every expert's columns (vLLM's flag)")
    grammar_compile_timeout_s: float = option(
        5.0, "seconds one structured-output constraint may take to compile (in a worker process, killed past "
             "it); the request then gets a 400", name="grammar_compile_timeout")
    grammar_compile_memory_mb: int = option(
        512, "MiB of memory one structured-output constraint's compile may take (the worker's data limit, "
             "from what it holds when ready); past it the request gets a 400; 0: no limit",
        name="grammar_compile_memory")

    def __post_init__(self) -> None:
        if self.quantization is not None:
            QuantConfig.parse(self.quantization)  # a clear ConfigError before anything loads
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be an integer >= 1, not {self.tensor_parallel_size!r}")
        check_speculative_with_tp(self.speculative, self.tensor_parallel_size)
        if not self.grammar_compile_timeout_s > 0:
            raise ConfigError("--grammar-compile-timeout must be positive")
        if not isinstance(self.grammar_compile_memory_mb, int) or self.grammar_compile_memory_mb < 0:
            raise ConfigError(f"--grammar-compile-memory must be a whole number of MiB >= 0, "
                              f"not {self.grammar_compile_memory_mb!r}")
        if self.scheduler.preemption_mode == "swap" and self.cache.swap_space == 0:
            raise ConfigError("--preemption-mode swap needs host memory for the swapped blocks: --swap-space > 0")

    @property
    def quant(self) -> QuantConfig | None:
        return None if self.quantization is None else QuantConfig.parse(self.quantization)

    def with_scheduler(self, **kwargs) -> "EngineConfig":
        return replace(self, scheduler=replace(self.scheduler, **kwargs))

    def with_cache(self, **kwargs) -> "EngineConfig":
        return replace(self, cache=replace(self.cache, **kwargs))
