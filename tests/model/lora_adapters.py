"""Random LoRA adapters in peft's format for the tiny test models, and peft's merged twin as reference."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: Path, directory: Path, rank: int, targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0,
                 alpha: float | None = None, rslora: bool = False) -> Path:
    """Save a peft LoRA adapter of `rank` on the model at `base` with random A and B (peft starts B at
    zero, which would make every adapter the base model)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                        lora_dropout=0.0, bias="none", use_rslora=rslora, init_lora_weights=False,
                        task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft_model.save_pretrained(directory)
    return directory


def merged_greedy(base: Path, adapter: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """peft's reference: the adapter merged into the base weights (merge_and_unload), greedy."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()
