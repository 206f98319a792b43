"""Random-weight checkpoints of every architecture we serve, built with transformers, saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def make_tiny_model(kind: str, directory: Path, shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random model of `kind` (llama | llama3 | qwen2 | qwen3 | phi3 | mixtral | qwen3_moe |
    llama4 | mistral | gemma3) into `directory`."""
    import transformers

    torch.manual_seed(0)
    kw = {**COMMON, **overrides}
    if kind == "llama":
        config = transformers.LlamaConfig(**kw, tie_word_embeddings=False)
    elif kind == "llama3":
        config = transformers.LlamaConfig(**kw, tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{"use_sliding_window": False, **kw}, tie_word_embeddings=True)
    elif kind == "qwen3":  # per-head q/k norms; head_dim wider than hidden / heads, as in Qwen3-0.6B
        config = transformers.Qwen3Config(**{"use_sliding_window": False, **kw, "head_dim": 32, **overrides},
                                          tie_word_embeddings=True)
    elif kind == "phi3":  # fused qkv_proj / gate_up_proj in the checkpoint; partial RoPE like Phi-4-mini
        config = transformers.Phi3Config(**kw, pad_token_id=0, partial_rotary_factor=0.5, tie_word_embeddings=False)
    elif kind == "mixtral":  # 4 experts, top 2 (renormalised)
        config = transformers.MixtralConfig(**{"sliding_window": None, **kw}, num_local_experts=4,
                                            num_experts_per_tok=2, tie_word_embeddings=False)
    elif kind == "qwen3_moe":  # 6 experts, top 2 not renormalised; layer 0 dense (mlp_only_layers)
        config = transformers.Qwen3MoeConfig(**{"head_dim": 32, "num_experts": 6, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 48, "norm_topk_prob": False,
                                                "mlp_only_layers": [0], **kw},
                                             tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "llama4":  # dense layers 0 and 2, MoE 1 and 3 (4 experts, top 1, a shared expert), layer 3 NoPE
        config = transformers.Llama4TextConfig(**{"intermediate_size": 64, "intermediate_size_mlp": 128,
                                                  "num_hidden_layers": 4, "head_dim": 16, "num_local_experts": 4,
                                                  "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
                                                  "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 512,
                                                  "use_qk_norm": True, "pad_token_id": 0,
                                                  **{k: v for k, v in kw.items()
                                                     if k not in ("intermediate_size", "num_hidden_layers")}})
    elif kind == "gemma3":  # sliding layers 0, 2, 3 (window 8), full layer 1 with linear RoPE scaling
        config = transformers.Gemma3TextConfig(**{
            **kw, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                 "sliding_attention"],
            "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0, "pad_token_id": 0, **overrides})
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, "head_dim": 32, **kw})
    else:
        raise ValueError(kind)
    config.eos_token_id = 2
    config.bos_token_id = 1
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms non-trivial so a missing weight shows up in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    return directory


def add_word_tokenizer(directory: Path, vocab_size: int = 320) -> Path:
    """A word-level tokenizer.json (token i is "t{i}", whitespace-split) saved beside a tiny model, so
    an Engine or `ferrylm serve` can load the directory (transformers' fast tokenizer, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(
        str(directory))
    return directory


def transformers_greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """The reference: transformers' greedy loop over the whole sequence every step (no KV cache, so its
    masks, a sliding window's too, are rebuilt each time); (new tokens, their logprobs)."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(tokens):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(row.argmax()))
            logprobs.append(row[ids[-1]].item())
    return ids[len(prompt):], logprobs


def assert_same_greedy(want: list, got: list, tolerance: float = 1e-4) -> None:
    """Two engines' RequestOutputs: the same tokens, the same top logprob keys, values within `tolerance`."""
    for a, b in zip(want, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < tolerance
