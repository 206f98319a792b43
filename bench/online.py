"""Online serving benchmark in the style of `vllm bench serve`: a load generator against the
OpenAI-compatible server (a running one via --base-url, or one it starts itself).

Scenarios: Poisson arrivals at several request rates, then fixed concurrencies. For each: TTFT,
inter-token latency (ITL) and end-to-end latency p50/p90/p99, output tokens/s, and goodput under
an SLO (TTFT < 1 s and mean ITL < 100 ms). Then, side by side, output tokens/s through HTTP at
concurrency 32 vs the offline `LLM` on the same requests. Prints a table, writes a PNG of the
percentiles against load and a JSON of the figures under bench/out/.

    .venv/bin/python bench/online.py                       # default run, a few minutes on 2 cores
    .venv/bin/python bench/online.py --rates 1,2,4,8,16 --concurrencies 1,8,32,64 --num-prompts 128
    .venv/bin/python bench/online.py --base-url http://127.0.0.1:8000 --no-offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPUS = Path(__file__).with_name("corpus.txt")
OUT = Path(__file__).with_name("out")


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Summary:
    scenario: str
    load: float  # request rate (req/s) or concurrency
    completed: int
    failed: int
    seconds: float
    req_per_s: float
    output_tok_per_s: float
    goodput: float  # requests per second meeting the SLO
    ttft: list[float]  # p50, p90, p99 (seconds)
    itl: list[float]
    e2e: list[float]
    errors: dict[str, int] = field(default_factory=dict)  # each failure's reason (status and body, or exception)


# -- prompts ---------------------------------------------------------------------------------
def make_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    """`n` token-id prompts of `input_len` tokens, cut from the corpus (same ids for HTTP and offline)."""
    from ferrylm.model.loaders.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model("smollm2-135m"))
    text = CORPUS.read_text() if CORPUS.exists() else " ".join(f"word{i} and more {i * 7}" for i in range(4000))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < input_len * 4:
        ids = ids + ids
    rng = random.Random(seed)
    return [ids[(s := rng.randrange(0, len(ids) - input_len)):s + input_len] for _ in range(n)]


# -- one request -----------------------------------------------------------------------------
async def send_one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """Stream one completion; TTFT at the first text event, ITL between later ones."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.e2e, result.ok = time.perf_counter() - start, True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = repr(e)
    return result


# -- load shapes -----------------------------------------------------------------------------
async def run_rate(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, rate: float,
                   seed: int) -> tuple[list[RequestResult], float]:
    """Poisson arrivals: exponential gaps with mean 1/rate (rate inf: all at once)."""
    rng = random.Random(seed)
    async with _client(base_url) as client:
        start, tasks = time.perf_counter(), []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send_one(client, model, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def run_concurrency(base_url: str, model: str, prompts: list[list[int]], max_tokens: int,
                          concurrency: int) -> tuple[list[RequestResult], float]:
    """A closed loop: `concurrency` clients, each sending its next request when the last one ends."""
    queue = list(reversed(prompts))
    results: list[RequestResult] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            results.append(await send_one(client, model, queue.pop(), max_tokens))

    async with _client(base_url) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def _client(base_url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits)


def summarize(scenario: str, load: float, results: list[RequestResult], seconds: float, slo_ttft: float,
              slo_itl: float) -> Summary:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> list[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 99)] if values else [float("nan")] * 3

    good = [r for r in ok if r.ttft < slo_ttft and (not r.itls or float(np.mean(r.itls)) < slo_itl)]
    tokens = sum(r.output_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.ok)
    return Summary(scenario, load, len(ok), len(results) - len(ok), seconds, len(ok) / seconds, tokens / seconds,
                   len(good) / seconds, pct([r.ttft for r in ok]), pct([x for r in ok for x in r.itls]),
                   pct([r.e2e for r in ok]), dict(errors))


# -- the server and the offline baseline -----------------------------------------------------
def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ferrylm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", args.model, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base_url + "/ready", timeout=10).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become ready")


class OfflineBaseline:
    """The same requests through the offline LLM (no HTTP), `max_num_seqs` = the HTTP concurrency."""

    def __init__(self, args: argparse.Namespace):
        from ferrylm import LLM, SamplingParams

        self.llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.compare_concurrency)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def tok_per_s(self, prompts: list[list[int]]) -> float:
        """Runs in a worker thread, as the server's engine loop does: on this machine the same
        generate() is several times slower from the main thread (OpenMP under CPU contention)."""
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(self._tok_per_s, prompts).result()

    def _tok_per_s(self, prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


# -- report ----------------------------------------------------------------------------------
def print_table(rows: list[Summary]) -> None:
    head = (f"{'scenario':<12}{'load':>6}{'ok':>5}{'fail':>5}{'req/s':>7}{'out tok/s':>10}{'goodput':>8} "
            f"{'TTFT p50/p90/p99 (ms)':>24} {'ITL p50/p90/p99 (ms)':>22} {'E2E p50/p90/p99 (s)':>21}")
    print(head)
    print("-" * len(head))
    for s in rows:
        ms = lambda v: "/".join(f"{x * 1000:.0f}" for x in v)  # noqa: E731
        sec = "/".join(f"{x:.2f}" for x in s.e2e)
        load = "inf" if s.load == float("inf") else f"{s.load:g}"
        print(f"{s.scenario:<12}{load:>6}{s.completed:>5}{s.failed:>5}{s.req_per_s:>7.2f}{s.output_tok_per_s:>10.1f}"
              f"{s.goodput:>8.2f} {ms(s.ttft):>24} {ms(s.itl):>22} {sec:>21}")
    for s in rows:
        for reason, count in s.errors.items():
            print(f"  failed in {s.scenario} {s.load:g}: {count} x {reason}")


def plot(rows: list[Summary], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for row_axes, scenario in zip(axes, ("rate", "concurrency")):
        sel = [s for s in rows if s.scenario == scenario]
        x = [s.req_per_s if scenario == "rate" else s.load for s in sel]
        for ax, metric, unit in zip(row_axes, ("ttft", "itl", "e2e"), ("s", "s", "s")):
            for i, q in enumerate(("p50", "p90", "p99")):
                ax.plot(x, [getattr(s, metric)[i] for s in sel], marker="o", label=q)
            ax.set_title(f"{metric.upper()} vs {'achieved req/s' if scenario == 'rate' else 'concurrency'}")
            ax.set_ylabel(unit)
            ax.set_xlabel("req/s" if scenario == "rate" else "concurrent clients")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def run_scenarios(args: argparse.Namespace, base_url: str) -> list[Summary]:
    rows = []
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    asyncio.run(run_concurrency(base_url, args.served_model, prompts[:2], 4, 2))  # warm-up
    for rate in args.rates:
        results, secs = asyncio.run(run_rate(base_url, args.served_model, prompts, args.max_tokens, rate, args.seed))
        rows.append(summarize("rate", rate, results, secs, args.slo_ttft, args.slo_itl))
        print(f"rate {rate}: {rows[-1].completed} ok in {secs:.1f}s", file=sys.stderr)
    for conc in args.concurrencies:
        # Enough requests for a few waves at low concurrency, two full waves at high concurrency.
        n = min(max(4 * conc, 8), max(args.num_prompts, 2 * conc))
        conc_prompts = make_prompts(n, args.input_len, args.seed)
        results, secs = asyncio.run(run_concurrency(base_url, args.served_model, conc_prompts, args.max_tokens,
                                                    conc))
        rows.append(summarize("concurrency", conc, results, secs, args.slo_ttft, args.slo_itl))
        print(f"concurrency {conc}: {rows[-1].completed} ok in {secs:.1f}s", file=sys.stderr)
    return rows


def compare_with_offline(args: argparse.Namespace, base_url: str) -> tuple[Summary, float | None]:
    """HTTP at the compare concurrency vs the offline LLM, alternated `--compare-repeats` times; the best
    of each counts (the machine is shared: the best run is the one least disturbed)."""
    prompts = make_prompts(args.compare_prompts, args.input_len, args.seed + 1)
    offline = None if args.no_offline else OfflineBaseline(args)
    best_http, best_offline = None, None
    for _ in range(args.compare_repeats):
        results, secs = asyncio.run(run_concurrency(base_url, args.served_model, prompts, args.max_tokens,
                                                    args.compare_concurrency))
        http = summarize("http-vs-llm", args.compare_concurrency, results, secs, args.slo_ttft, args.slo_itl)
        if best_http is None or http.output_tok_per_s > best_http.output_tok_per_s:
            best_http = http
        if offline is not None:
            tps = offline.tok_per_s(prompts)
            best_offline = max(tps, best_offline or 0.0)
        print(f"compare: HTTP {http.output_tok_per_s:.1f} tok/s, offline {best_offline} tok/s", file=sys.stderr)
    return best_http, best_offline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--served-model", default=None, help="model name to send (default: --model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64, help="for the server this script starts")
    p.add_argument("--rates", default="2,4,8,inf", help="Poisson request rates (req/s), comma-separated")
    p.add_argument("--concurrencies", default="1,8,32", help="closed-loop client counts, comma-separated")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="requests per rate scenario (concurrency c sends min(max(4c, 8), max(this, 2c)))")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--compare-concurrency", type=int, default=32)
    p.add_argument("--compare-prompts", type=int, default=64)
    p.add_argument("--compare-repeats", type=int, default=2, help="alternate HTTP/offline runs this many times")
    p.add_argument("--no-offline", action="store_true", help="skip the offline LLM comparison")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT (s)")
    p.add_argument("--slo-itl", type=float, default=0.1, help="goodput SLO on mean ITL (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    args.rates = [float(x) for x in args.rates.split(",")]
    args.concurrencies = [int(x) for x in args.concurrencies.split(",")]
    args.served_model = args.served_model or args.model
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proc, base_url = (None, args.base_url) if args.base_url else start_server(args)
    try:
        rows = run_scenarios(args, base_url)
        http, offline = compare_with_offline(args, base_url)  # the server idles while the LLM runs
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_table(rows + [http])
    print(f"\nconcurrency {args.compare_concurrency}, {args.compare_prompts} requests x {args.input_len} in / "
          f"{args.max_tokens} out: HTTP server {http.output_tok_per_s:.1f} output tok/s"
          + (f", offline LLM {offline:.1f} tok/s (HTTP = {http.output_tok_per_s / offline:.0%} of offline)"
             if offline else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    if plot(rows, args.out / "online.png"):
        print(f"plot: {args.out / 'online.png'}")
    (args.out / "online.json").write_text(json.dumps(
        {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "rows": [asdict(r) for r in rows + [http]], "offline_tok_per_s": offline}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
