"""Random-weight Llama-family runners and engines, for the GPU tests and bench/gpu.py.

No checkpoint or tokenizer files: weights are drawn (seeded) under checkpoint names and go through
the real loader; detokenization uses a stand-in vocabulary. `build_runner` asks the ModelRunner for a
given attention backend, and captures decode CUDA graphs when the runner does not do so itself.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from ferrylm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

SPECS = {  # published shapes; rope scaling as in the released configs
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=(("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0),
                                       ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling=(("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                                       ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))),
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, tie_word_embeddings=False),
}


def model_config(name: str, max_positions: int = 131072) -> ModelConfig:
    return ModelConfig(architecture="llama", max_position_embeddings=max_positions, name=name, **SPECS[name])


class RandomCheckpoint:
    """Quacks like loader.Checkpoint: `.config`, `.source.path` and `.weights()` under HF names.

    Weights are normal(0, std) drawn from a generator seeded per tensor on `device` (CPU draws are
    reproducible everywhere; draw on CUDA for 8B-sized models). Norm weights are near 1.
    """

    def __init__(self, config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu", std: float = 0.02):
        self.config, self.seed, self.device, self.std = config, seed, torch.device(device), std
        self.source = SimpleNamespace(path=f"<random {config.name}, seed {seed}>", kind="random")

    def _shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)), ("model.norm.weight", (c.hidden_size,))]
        if not c.tie_word_embeddings:
            shapes.append(("lm_head.weight", (c.vocab_size, c.hidden_size)))
        layer = {"self_attn.q_proj": (q, c.hidden_size), "self_attn.k_proj": (kv, c.hidden_size),
                 "self_attn.v_proj": (kv, c.hidden_size), "self_attn.o_proj": (c.hidden_size, q),
                 "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
                 "mlp.up_proj": (c.intermediate_size, c.hidden_size),
                 "mlp.down_proj": (c.hidden_size, c.intermediate_size),
                 "input_layernorm": (c.hidden_size,), "post_attention_layernorm": (c.hidden_size,)}
        for i in range(c.num_layers):
            shapes += [(f"model.layers.{i}.{name}.weight", shape) for name, shape in layer.items()]
        return shapes

    def weights(self):
        for i, (name, shape) in enumerate(self._shapes()):
            gen = torch.Generator(self.device).manual_seed(self.seed * 100003 + i)
            w = torch.randn(shape, generator=gen, device=self.device)
            yield name, (1.0 + 0.1 * w) if name.endswith("norm.weight") else w * self.std


class StandInVocab:
    """Enough of a Hugging Face tokenizer for the engine's detokenizer: token i renders as " t{i}"."""

    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return [f" t{i}" for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t[1:]) % self.vocab_size for t in text.split() if t[1:].isdigit()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.convert_tokens_to_string(self.convert_ids_to_tokens(ids))


def build_runner(config: ModelConfig, *, device: str, dtype: torch.dtype, num_blocks: int, max_model_len: int,
                 attention: str = "auto", cuda_graphs: bool = False, max_num_seqs: int = 256, seed: int = 0,
                 weights_device: str | None = None, block_size: int = 16):
    """A ModelRunner on random weights with num_blocks usable KV blocks plus one spare (the graph pad block).

    attention: "auto" (whatever the runner picks), "torch" (the oracle), "cpu" or "triton" (see
    ferrylm.model.attention.select_backend). cuda_graphs=False runs every step eagerly.
    """
    from ferrylm.model.runner import ModelRunner

    params = inspect.signature(ModelRunner).parameters
    kwargs = {"max_num_seqs": max_num_seqs} if "max_num_seqs" in params else {}
    if "enforce_eager" in params:
        kwargs["enforce_eager"] = not cuda_graphs
    checkpoint = RandomCheckpoint(config, seed, weights_device or device)
    runner = ModelRunner(checkpoint, CacheConfig(block_size=block_size, num_blocks=num_blocks + 1), dtype,
                         torch.device(device), max_model_len, attention=attention, **kwargs)
    if cuda_graphs and getattr(runner, "graphs", None) is None:
        from ferrylm.model.compile.cuda_graphs import CudaGraphRunner

        graphs = CudaGraphRunner(runner.model, runner.kv_caches, max_num_seqs, -(-max_model_len // block_size),
                                 pad_block=runner.kv_caches[0][0].shape[0] - 1, block_size=block_size)
        graphs.capture()
        runner.model = GraphedModel(runner.model, graphs)
    return runner


class GraphedModel:
    """Stands in for runner.model so ModelRunner.execute replays decode graphs (until runner.py does)."""

    def __init__(self, model, graphs):
        self.model, self.graphs = model, graphs

    def __call__(self, batch, kv_caches):
        return self.graphs.forward(batch)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def build_engine(runner, num_blocks: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 block_size: int = 16):
    """An Engine over `runner` with the stand-in vocabulary; only num_blocks KV blocks are handed out."""
    from ferrylm.engine.engine import Engine
    from ferrylm.tokenizer import Tokenizer

    config = EngineConfig(model=runner.config.name, device=str(runner.device),
                          cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens,
                                                    max_model_len=max_model_len))
    tokenizer = Tokenizer(StandInVocab(runner.config.vocab_size), ())
    return Engine(config, runner, tokenizer, max_model_len)


def generate_greedy(engine, prompts: list[list[int]], max_tokens: int, id_prefix: str = "") -> list[list[int]]:
    """Greedy, ignore_eos, run until the engine is idle; outputs in prompt order."""
    from ferrylm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{id_prefix}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[rid] for rid in ids]
