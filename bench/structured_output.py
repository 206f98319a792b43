"""Structured output cost: throughput of a batch where half the requests are JSON-schema guided vs
the same batch unguided, side by side in one process (alternating rounds), plus schema compile
times (backend start-up, cold compile, cached) and the schema-valid rate.

    .venv/bin/python bench/structured_output.py [--requests 64] [--rounds 3] [--dtype auto]

Every timed round reads /proc/stat: CPU used by anything but this process is reported, and a
round where it passes 5% of the machine is flagged. Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.sampling_params import StructuredOutputsParams  # noqa: E402


def schema(i: int, min_length: int = 0) -> dict:
    """Four distinct schemas (so compiles happen while the batch runs). With `min_length` the strings
    are long enough that the output outlasts max_tokens: every row then runs exactly max_tokens, as
    the unguided ones do (ignore_eos), and the two batches differ only by the guidance."""
    fields = ["title", "summary", "mood", "place"][: 2 + i % 3]
    text = {"type": "string", "maxLength": 48} | ({"minLength": min_length} if min_length else {})
    return {"type": "object", "properties": {
        **{f: text for f in fields},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": [*fields, "tags", "score"]}


def _jiffies() -> tuple[int, int]:
    machine = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:8]]
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return sum(machine) - machine[3] - machine[4] - int(own[11]) - int(own[12]), sum(machine)


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int, float, list]:
    """(seconds, generated tokens, foreign CPU share, outputs)."""
    foreign0, total0 = _jiffies()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    foreign1, total1 = _jiffies()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, tokens, max(0.0, (foreign1 - foreign0) / max(1, total1 - total0)), outs


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=args.requests, max_num_batched_tokens=2048)
    grammars = llm.engine.grammars

    # compile times: backend start-up (xgrammar import + tokenizer tables), a cold schema, a cached one
    t = time.perf_counter()
    grammars.submit(StructuredOutputsParams(regex="x")).result()
    startup = time.perf_counter() - t
    cold = []
    for i in range(4):
        spec = StructuredOutputsParams(json=schema(i))
        t = time.perf_counter()
        grammars.submit(spec).result()
        cold.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(100):
        grammars.submit(StructuredOutputsParams(json=schema(0))).result()
    cached = (time.perf_counter() - t) / 100

    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write a short record about story number {i}: "
                                         "a title, a summary, tags and a score."}]) for i in range(args.requests)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def guided(i: int, min_length: int, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema(i % 4, min_length)))

    half = [plain if i % 2 == 0 else guided(i, 40, args.max_tokens) for i in range(args.requests)]
    timed(llm, prompts[:8], [plain] * 8)  # warm-up (compiled graphs, allocator)
    rows: dict[str, list[tuple[float, int, float]]] = {"unguided": [], "50% guided": []}
    for _ in range(args.rounds):
        for name, params in (("unguided", [plain] * args.requests), ("50% guided", half)):
            seconds, tokens, foreign, _ = timed(llm, prompts, params)
            rows[name].append((seconds, tokens, foreign))
    # validity: the free-length schemas, with room to finish
    checks = [guided(i, 0, 256) for i in range(args.requests)]
    outs = timed(llm, prompts, checks)[3]
    valid = sum(o.outputs[0].finish_reason.value == "stop" and _parses(o.outputs[0].text) for o in outs)
    checked = len(outs)
    print(f"{'batch':<12} {'tok/s (median)':>15} {'tokens':>7} {'max foreign CPU':>16}")
    medians = {}
    for name, runs in rows.items():
        medians[name] = statistics.median(tokens / seconds for seconds, tokens, _ in runs)
        flag = " (noisy)" if max(f for *_, f in runs) > 0.05 else ""
        print(f"{name:<12} {medians[name]:>15.1f} {runs[0][1]:>7} {max(f for *_, f in runs):>15.1%}{flag}")
    print(f"ratio 50% guided / unguided: {medians['50% guided'] / medians['unguided']:.3f}")
    print(f"schema-valid: {valid}/{checked}")
    print(f"compile: backend start-up {startup * 1e3:.0f} ms, cold schema {statistics.median(cold) * 1e3:.1f} ms "
          f"(median of 4), cached {cached * 1e6:.1f} us")
    print(f"threads: {os.cpu_count()} CPUs, dtype {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
