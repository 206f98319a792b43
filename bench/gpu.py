"""GPU benchmark and checks for the Triton backend and decode CUDA graphs, in one device call (< 5 min).

For random-weight models of SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes, built in bf16 on the
GPU (no checkpoint files), it reports
  (a) batch-1 decode tokens/s at a 512-token context (graph replay alone, and through the Engine)
      against the HBM roofline: measured copy bandwidth / (weight + KV bytes read per step);
  (b) offline throughput, 256 requests (prompts 128-1024, outputs 128-1024 tokens, ignore_eos):
      FerryLM's Engine vs transformers generate() in static batches on the same prompts; each side
      runs in a time box and reports the tokens it finished per second (a prefix when cut short);
  (c) one 8k-token prefill against the bf16 matmul roofline (FLOPs / measured GEMM throughput).
First it checks the kernels against the torch backend in bf16 (relative error < 1e-2) and that
greedy outputs of a SmolLM2-shaped model in float32 are the same on GPU (Triton + graphs) and CPU.

Detokenization uses a stand-in vocabulary (token i renders as " t{i}"; tests/gpu/random_model.py):
outputs are token ids, their text is irrelevant here. Every section catches its own errors and
has a time box. Prints a table last and writes $OUT/gpu.json (default bench/out).

    python bench/gpu.py             # on the GPU machine, ~4-5 minutes
    python bench/gpu.py --smoke     # CPU, tiny shapes, torch-native backend: import/typo check
    python bench/gpu.py --models smollm2-135m --budget 120
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FERRYLM_DISABLE_CPU_KERNELS", "1")  # the CPU side is the torch-native oracle

import torch  # noqa: E402

BLOCK = 16
MODELS = ["smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"]


@dataclass(frozen=True)
class Plan:
    """Workload sizes and time boxes; --smoke shrinks everything to seconds on a CPU."""

    device: str
    models: tuple[str, ...]
    requests: int = 256
    prompt_range: tuple[int, int] = (128, 1024)
    output_range: tuple[int, int] = (128, 1024)
    decode_context: int = 512
    decode_steps: int = 100
    prefill_tokens: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    hf_batch: int = 64
    engine_box_s: float = 30.0
    hf_box_s: float = 15.0

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    @property
    def max_model_len(self) -> int:
        return max(self.prefill_tokens, self.prompt_range[1] + self.output_range[1], self.decode_context + 256) + BLOCK


def smoke_plan() -> Plan:
    return Plan("cpu", ("tiny",), requests=8, prompt_range=(16, 64), output_range=(8, 32), decode_context=32,
                decode_steps=8, prefill_tokens=128, max_num_seqs=8, max_num_batched_tokens=64, hf_batch=4,
                engine_box_s=30, hf_box_s=30)


class Budget:
    """Wall-clock budget of the whole run; sections get min(their box, what is left)."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def deadline(self, box_s: float) -> float:
        return time.perf_counter() + max(0.0, min(box_s, self.left()))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_section(out: dict, key: str, budget: Budget, needs_s: float, fn, *args) -> None:
    """Run one section into out[key]: its figures, or its error, or why it was skipped."""
    if budget.left() < needs_s:
        out[key] = {"skipped": f"out of time ({budget.left():.0f} s left, needs ~{needs_s:.0f} s)"}
    else:
        start = time.perf_counter()
        try:
            out[key] = {**fn(*args), "section_s": round(time.perf_counter() - start, 1)}
        except Exception as e:  # noqa: BLE001 - report and carry on with the next section
            out[key] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=8)[-3000:]}
        free_memory()
    print(f"[{key}] {json.dumps(out[key], default=str)[:800]}", flush=True)


# -- environment and rooflines ---------------------------------------------------------------------
def measure_env(plan: Plan) -> dict:
    info = {"torch": torch.__version__, "device": plan.device, "python": sys.version.split()[0]}
    for pkg in ("triton", "transformers"):
        try:
            info[pkg] = __import__(pkg).__version__
        except ImportError:
            info[pkg] = None
    cuda = plan.device == "cuda"
    if cuda:
        info["gpu"] = torch.cuda.get_device_name()
    n = (1 << 29) if cuda else (1 << 22)  # bf16 elements: 1 GiB on the GPU
    src = torch.randn(n, device=plan.device).to(plan.dtype)
    dst = torch.empty_like(src)
    info["copy_bandwidth_GBs"] = _best_rate(lambda: dst.copy_(src), 2 * src.numel() * src.element_size()) / 1e9
    m = 8192 if cuda else 512
    a, b = (torch.randn(m, m, device=plan.device).to(plan.dtype) for _ in range(2))
    info["matmul_TFLOPs"] = _best_rate(lambda: torch.matmul(a, b), 2 * m ** 3) / 1e12
    return info


def _best_rate(fn, work: float, reps: int = 10) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / reps)
    return work / best


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix once; an untied embedding only by row."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.embed_tokens.weight
    return total if model.config.tie_word_embeddings else total - embed.numel() * embed.element_size()


def kv_bytes(config, tokens: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * tokens * config.num_kv_heads * config.head_dim * itemsize


def layer_params(c) -> int:
    """Weights of the decoder layers' matmuls (q, k, v, o projections and the SwiGLU MLP)."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.num_layers * (c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size)


def prefill_flops(c, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill: projections and MLP, QK^T and PV over the causal half, one
    row of logits."""
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2
    return 2 * tokens * layer_params(c) + attention + 2 * c.hidden_size * c.vocab_size


# -- per-model sections ----------------------------------------------------------------------------
@dataclass
class Bench:
    """One model's runner and what the sections need to know about it."""

    name: str
    plan: Plan
    env: dict
    runner: object = None
    num_blocks: int = 0

    @property
    def config(self):
        return self.runner.config


def build(bench: Bench) -> dict:
    from ferrylm.model.runner import kv_bytes_per_block
    from tests.gpu.random_model import build_runner, model_config

    plan = bench.plan
    config = model_config(bench.name, plan.max_model_len)
    per_seq = -(-(plan.prompt_range[1] + plan.output_range[1]) // BLOCK)
    want = max(min(plan.requests, plan.max_num_seqs) * per_seq, -(-plan.max_model_len // BLOCK)) + 8
    if plan.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        weights = 2 * (layer_params(config) + 2 * config.vocab_size * config.hidden_size)
        fits = int(0.8 * (free - weights - (8 << 30)) / kv_bytes_per_block(config, BLOCK, plan.dtype))
        want = max(64, min(want, fits))
    bench.num_blocks = want
    cuda, fallbacks = plan.device == "cuda", {}
    attempts = [("triton", True), ("triton", False), ("torch", False)] if cuda else [("torch", False)]
    for attention, graphs in attempts:  # a failing kernel or capture must not cost the model its numbers
        try:
            bench.runner = build_runner(config, device=plan.device, dtype=plan.dtype, num_blocks=want,
                                        max_model_len=plan.max_model_len, attention=attention, cuda_graphs=graphs,
                                        max_num_seqs=plan.max_num_seqs)
            _smoke_forward(bench)
            break
        except Exception as e:  # noqa: BLE001 - recorded, then the next, simpler configuration
            if (attention, graphs) == attempts[-1]:
                raise
            fallbacks[f"{attention}{'+graphs' if graphs else ''}"] = f"{type(e).__name__}: {e}"[:500]
            bench.runner = None
            free_memory()
    backend = type(bench.runner.model.layers[0].self_attn.backend).__name__
    return {"kv_blocks": want, "backend": backend, "cuda_graphs": _graphs(bench.runner) is not None,
            "failed_configurations": fallbacks, "weight_GB": decode_weight_bytes(bench.runner.model) / 1e9}


@torch.inference_mode()
def _smoke_forward(bench: Bench) -> None:
    """One prefill and one decode step (compiles the kernels; raises if they do not run)."""
    from ferrylm.model.forward_batch import ForwardBatch

    runner = bench.runner
    runner.model(ForwardBatch.build([[7] * 40], [0], [[0, 1, 2]], BLOCK, device=runner.device), runner.kv_caches)
    hidden = runner.model(ForwardBatch.build([[8]], [40], [[0, 1, 2]], BLOCK, device=runner.device), runner.kv_caches)
    if not torch.isfinite(hidden.float()).all():
        raise FloatingPointError("non-finite hidden states after a prefill and a decode step")


def _graphs(runner):
    from tests.gpu.random_model import GraphedModel

    model = runner.model
    return model.graphs if isinstance(model, GraphedModel) else getattr(runner, "graphs", None)


@torch.inference_mode()
def decode_b1(bench: Bench) -> dict:
    from ferrylm.model.forward_batch import ForwardBatch

    plan, runner, model = bench.plan, bench.runner, bench.runner.model
    ctx, dev = plan.decode_context, runner.device
    rng = random.Random(2)
    prompt = [rng.randrange(10, bench.config.vocab_size) for _ in range(ctx)]
    table = list(range(-(-(ctx + 1) // BLOCK)))
    model(ForwardBatch.build([prompt], [0], [table], BLOCK, device=dev), runner.kv_caches)
    batch = ForwardBatch.build([[prompt[-1]]], [ctx], [table], BLOCK, device=dev)
    graphs = _graphs(runner)
    step = (lambda: graphs.forward(batch)) if graphs else (lambda: model(batch, runner.kv_caches))
    for _ in range(3):
        model.compute_logits(step()).argmax(-1)
    sync()
    start = time.perf_counter()
    for _ in range(plan.decode_steps):
        model.compute_logits(step()).argmax(-1)
    sync()
    per_token = (time.perf_counter() - start) / plan.decode_steps
    step_bytes = decode_weight_bytes(model) + kv_bytes(bench.config, ctx, plan.dtype)
    roofline = bench.env["copy_bandwidth_GBs"] * 1e9 / step_bytes
    return {"context": ctx, "graph_replay": bool(graphs and graphs.can_replay(batch)), "ms_per_token": per_token * 1e3,
            "tok_s": 1 / per_token, "roofline_tok_s": roofline, "fraction_of_roofline": (1 / per_token) / roofline,
            "bytes_per_step_MB": step_bytes / 1e6, "engine_tok_s": _engine_decode_rate(bench, prompt)}


def warm_engine(bench: Bench):
    """A fresh Engine on the runner, after a prefill, a mixed step (one decode row next to a prefill
    chunk) and decodes, so that every kernel variant is compiled before anything is timed."""
    from ferrylm.sampling_params import SamplingParams
    from tests.gpu.random_model import build_engine

    plan = bench.plan
    engine = build_engine(bench.runner, bench.num_blocks, plan.max_model_len, plan.max_num_seqs,
                          plan.max_num_batched_tokens)
    engine.add_request("warm-a", [11] * 200, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.add_request("warm-b", [12] * 40, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _engine_decode_rate(bench: Bench, prompt: list[int]) -> float:
    """Decode tokens/s of one request through Engine.step (scheduler, sampler, detokenizer included)."""
    from ferrylm.sampling_params import SamplingParams

    plan = bench.plan
    engine = warm_engine(bench)
    engine.add_request("b1", prompt, SamplingParams(temperature=0.0, max_tokens=plan.decode_steps + 1,
                                                    ignore_eos=True))
    engine.step()  # the prefill, which samples the first token
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - start)


@torch.inference_mode()
def prefill_long(bench: Bench) -> dict:
    from ferrylm.model.forward_batch import ForwardBatch

    plan, runner, model = bench.plan, bench.runner, bench.runner.model
    tokens = plan.prefill_tokens
    rng = random.Random(3)
    ids = [rng.randrange(10, bench.config.vocab_size) for _ in range(tokens)]
    table = list(range(-(-tokens // BLOCK)))
    times = []
    for n in (tokens // 8, tokens, tokens):  # the first compiles and warms up
        batch = ForwardBatch.build([ids[:n]], [0], [table], BLOCK, device=runner.device)
        sync()
        start = time.perf_counter()
        model.compute_logits(model(batch, runner.kv_caches)[-1:]).argmax(-1)
        sync()
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    flops = prefill_flops(bench.config, tokens)
    roofline_s = flops / (bench.env["matmul_TFLOPs"] * 1e12)
    return {"tokens": tokens, "seconds": best, "TFLOPs": flops / best / 1e12, "roofline_s": roofline_s,
            "fraction_of_roofline": roofline_s / best}


def make_requests(plan: Plan, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    lens = [(rng.randint(*plan.prompt_range), rng.randint(*plan.output_range)) for _ in range(plan.requests)]
    return [[rng.randrange(10, vocab) for _ in range(p)] for p, _ in lens], [o for _, o in lens]


def offline_ferrylm(bench: Bench, budget: Budget) -> dict:
    from ferrylm.sampling_params import SamplingParams

    plan = bench.plan
    engine = warm_engine(bench)
    prompts, outputs = make_requests(plan, bench.config.vocab_size)
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    deadline, tokens0 = budget.deadline(plan.engine_box_s), engine.generation_tokens_total
    start, steps, finished = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests() and time.perf_counter() < deadline:
        finished += sum(o.finished for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - start
    complete = not engine.has_unfinished_requests()
    for i in range(len(prompts)):
        engine.abort(str(i))
    tokens = engine.generation_tokens_total - tokens0
    return {"requests": len(prompts), "finished": finished, "complete": complete, "steps": steps,
            "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "total_tok_s": (sum(map(len, prompts)) + tokens) / elapsed if complete else None}


def offline_transformers(bench: Bench, budget: Budget) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

    from tests.gpu.random_model import SPECS

    plan, spec = bench.plan, SPECS[bench.name]
    hf_config = LlamaConfig(vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
                            intermediate_size=spec["intermediate_size"], num_hidden_layers=spec["num_layers"],
                            num_attention_heads=spec["num_heads"], num_key_value_heads=spec["num_kv_heads"],
                            head_dim=spec["head_dim"], tie_word_embeddings=spec["tie_word_embeddings"],
                            max_position_embeddings=plan.max_model_len, eos_token_id=None, bos_token_id=None,
                            pad_token_id=0)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(plan.dtype)  # initialise in bf16 directly: an 8B fp32 copy would cost 32 GB
    try:
        with torch.device(plan.device):
            model = LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id = None
    deadline = budget.deadline(plan.hf_box_s)

    class Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), time.perf_counter() > deadline, device=input_ids.device)

    prompts, outputs = make_requests(plan, spec["vocab_size"])
    done_tokens, finished, start = 0, 0, time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([[5] * 8], device=plan.device), max_new_tokens=2, do_sample=False)
        start = time.perf_counter()
        for i in range(0, len(prompts), plan.hf_batch):
            if time.perf_counter() >= deadline:
                break
            chunk, news = prompts[i:i + plan.hf_batch], outputs[i:i + plan.hf_batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=plan.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=plan.device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(news), do_sample=False,
                                 pad_token_id=0, stopping_criteria=StoppingCriteriaList([Deadline()]))
            steps = out.shape[1] - width
            done_tokens += sum(min(n, steps) for n in news)  # a static batch runs to its longest request
            finished += sum(n <= steps for n in news)
    elapsed = time.perf_counter() - start
    return {"batch_size": plan.hf_batch, "finished": finished, "output_tokens": done_tokens, "seconds": elapsed,
            "tok_s": done_tokens / elapsed if elapsed > 0 else None}


def bench_model(name: str, plan: Plan, env: dict, budget: Budget) -> dict:
    out: dict = {}
    bench = Bench(name, plan, env)
    run_section(out, "build", budget, 20, build, bench)
    if bench.runner is not None:
        run_section(out, "decode_b1", budget, 10, decode_b1, bench)
        run_section(out, "prefill", budget, 10, prefill_long, bench)
        run_section(out, "offline_ferrylm", budget, 15, offline_ferrylm, bench, budget)
    bench.runner = None
    free_memory()
    run_section(out, "offline_transformers", budget, 15, offline_transformers, bench, budget)
    return out


# -- report ----------------------------------------------------------------------------------------
def _get(d: dict, *keys, fmt: str = "{:.0f}") -> str:
    for k in keys:
        d = d.get(k, {}) if isinstance(d, dict) else {}
    if isinstance(d, (int, float)) and not isinstance(d, bool):
        return fmt.format(d)
    return "-"


def table(results: dict) -> str:
    cols = ["model", "decode b1 tok/s", "roofline", "% roof", "engine b1", "offline FerryLM tok/s",
            "transformers tok/s", "ratio", "prefill 8k s", "roofline s", "prefill TFLOP/s"]
    rows = []
    for name, r in results["models"].items():
        ferry, hf = r.get("offline_ferrylm", {}).get("tok_s"), r.get("offline_transformers", {}).get("tok_s")
        rows.append([name, _get(r, "decode_b1", "tok_s"), _get(r, "decode_b1", "roofline_tok_s"),
                     _get(r, "decode_b1", "fraction_of_roofline", fmt="{:.0%}"),
                     _get(r, "decode_b1", "engine_tok_s"), _get(r, "offline_ferrylm", "tok_s"),
                     _get(r, "offline_transformers", "tok_s"), f"{ferry / hf:.1f}x" if ferry and hf else "-",
                     _get(r, "prefill", "seconds", fmt="{:.3f}"), _get(r, "prefill", "roofline_s", fmt="{:.3f}"),
                     _get(r, "prefill", "TFLOPs")])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    checks = results["checks"]
    for key in ("kernels_bf16", "greedy_fp32_gpu_vs_cpu"):
        c = checks.get(key, {})
        state = "PASS" if c.get("passed") else c.get("skipped") or c.get("error") or "FAIL"
        lines.append(f"check {key}: {state}")
    env = results["env"]
    lines.append(f"env: {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, triton {env.get('triton')}, "
                 f"copy {_get(env, 'copy_bandwidth_GBs')} GB/s, bf16 matmul {_get(env, 'matmul_TFLOPs')} TFLOP/s")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, torch-native backend")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget", type=float, default=270.0, help="seconds for the whole run")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--skip-checks", action="store_true")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.smoke:
        for name in ("gguf", "fastapi", "xgrammar", "uvicorn"):  # the GPU machine has none of these
            sys.modules.setdefault(name, None)
        plan = smoke_plan()
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    else:
        plan = Plan("cuda", tuple(args.models.split(",")), requests=args.requests)
    budget = Budget(args.budget)
    results: dict = {"plan": asdict(plan), "env": {}, "checks": {}, "models": {}}
    run_section(results, "env", budget, 0, measure_env, plan)
    env = results["env"]
    from tests.gpu.device_checks import greedy_parity, kernel_errors

    for key, fn in (("kernels_bf16", kernel_errors), ("greedy_fp32_gpu_vs_cpu", greedy_parity)):
        if plan.device != "cuda" or args.skip_checks:
            results["checks"][key] = {"skipped": "needs CUDA" if plan.device != "cuda" else "--skip-checks"}
        else:
            run_section(results["checks"], key, budget, 20, fn)
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / ("gpu_smoke.json" if args.smoke else "gpu.json")
    for name in plan.models:
        out_file.write_text(json.dumps(results, indent=2, default=str))  # partial results survive a kill
        results["models"][name] = bench_model(name, plan, env, budget)
    out_file.write_text(json.dumps(results, indent=2, default=str))
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
