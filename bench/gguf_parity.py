"""Greedy parity with llama.cpp on GGUF files written by llama.cpp's own converter, one per architecture.

For each architecture: a random-weight model from transformers' config class (seed 0, SmolLM2's
tokenizer, initializer_range 0.1 so that logits have margins and near-ties are rare), converted to
GGUF by the convert_hf_to_gguf.py of the llama.cpp tree bench/anchors/peers.py extracted, in f32 and
q8_0. Both engines get the same token ids (4 prompts of 24 random tokens) and decode 32 greedy tokens
each: FerryLM's offline LLM on the file (float32 activations; q8_0 blocks kept packed) and
llama-server (/completion, top_k 1, ignore_eos). Reported per file: how many of the 128 tokens agree
and where each prompt first diverges. Where f32 files diverge late, the cause is a near-tie of two
logits under different summation orders (each position's top-2 margin is printed at the divergence).

    .venv/bin/python bench/anchors/peers.py llamaserver   # once: builds llama.cpp (~12 minutes on 2 cores)
    .venv/bin/pip install sentencepiece                   # once: the converter imports it for these vocabularies
    .venv/bin/python bench/gguf_parity.py                 # ~5 minutes (converts once, cached in bench/.peers)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.llama_server import LlamaServerEngine  # noqa: E402
from bench.anchors.peers import LLAMA_SERVER, PEERS, gguf_path  # noqa: E402
from bench.moe_gguf import convert_hf, llama_cpp_tree  # noqa: E402

WORK = PEERS / "gguf-parity"
COMMON = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.1,
              tie_word_embeddings=False)
ARCHS = {  # name: (transformers config class, overrides)
    "llama3-rope-scaling": ("LlamaConfig", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.75, pad_token_id=0)),
    "llama4": ("Llama4TextConfig", dict(intermediate_size=256, intermediate_size_mlp=512, head_dim=64,
                                         num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                         attention_chunk_size=8192, use_qk_norm=True, pad_token_id=0)),
    "qwen3": ("Qwen3Config", dict(head_dim=64)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=64, sliding_window=512, query_pre_attn_scalar=64,
                                         pad_token_id=0)),
}
PROMPTS, PROMPT_LEN, NEW = 4, 24, 32


def write_hf(directory: Path, arch: str) -> None:
    import torch
    import transformers

    cls, overrides = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**COMMON, **overrides})
    config.bos_token_id, config.eos_token_id = 1, 2
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    smol = gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    tokenizer.save_pretrained(directory)
    cfg = directory / "tokenizer_config.json"  # the converter's Phi-3 reads a GPT-2 BPE vocabulary only so
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "GPT2Tokenizer"}))


def convert(arch: str, outtype: str) -> Path:
    tree = llama_cpp_tree()
    if tree is None:
        raise SystemExit("run `.venv/bin/python bench/anchors/peers.py llamaserver` first")
    out = WORK / f"{arch}.{outtype}.gguf"
    if out.exists():
        return out
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        write_hf(Path(tmp), arch)
        convert_hf(tree, Path(tmp), outtype, out)
    return out


def ferrylm(gguf: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and, per position, the margin between the top two logprobs."""
    from ferrylm import LLM, SamplingParams

    llm = LLM(str(gguf), dtype="float32", enforce_eager=True, max_num_seqs=PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    margins = []
    for o in outs:
        row = []
        for lp in o.outputs[0].logprobs:
            top = sorted(lp.values(), reverse=True)
            row.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        margins.append(row)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], margins


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--outtypes", nargs="+", default=["f32", "q8_0"])
    args = ap.parse_args()
    server = LLAMA_SERVER.bin / "llama-server"
    rng = random.Random(0)
    prompts = [[rng.randrange(3, COMMON["vocab_size"]) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    rows = []
    for arch in args.archs:
        for outtype in args.outtypes:
            gguf = convert(arch, outtype)
            ours, margins = ferrylm(gguf, prompts)
            engine = LlamaServerEngine(str(gguf), outtype, server=str(server), threads=2, slots=PROMPTS)
            try:
                theirs = [list(engine._complete(p, NEW)["tokens"]) for p in prompts]
            finally:
                engine.close()
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
            agree = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
            at = [None if f is None else round(margins[k][f], 4) for k, f in enumerate(first)]
            rows.append((arch, outtype, agree, first, at))
            print(json.dumps({"arch": arch, "file": outtype, "agree": agree, "first_divergence": first,
                              "top2_margin_there": at}), flush=True)
    print(f"\narch | file | tokens equal (of {PROMPTS * NEW}) | first divergence per prompt | "
          "FerryLM top-2 margin there")
    print("-----|------|------|------|------")
    for arch, outtype, agree, first, at in rows:
        print(f"{arch} | {outtype} | {agree} | {first} | {at}")


if __name__ == "__main__":
    main()
