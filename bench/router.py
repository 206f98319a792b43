"""Router benchmark: one `ferrylm gateway` in front of 2 `ferrylm serve` replicas, the same mixed
workload (80% short chats, 20% long prompts sharing one of 4 long documents) under each routing
policy, side by side in one run. Reports throughput, TTFT p50/p99 (all, short, long), the fleet's
prefix-cache hit rate and how the requests split across replicas; plots TTFT CDFs and bars.

    .venv/bin/python bench/router.py                  # ~6 minutes on 2 cores
    .venv/bin/python bench/router.py --quick          # a smoke run
Both replicas share this machine's cores, so absolute figures are low: compare the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("out")
CORPUS = Path(__file__).with_name("corpus.txt")
POLICIES = ("round-robin", "least-outstanding-tokens", "prefix-affinity")

from tests.e2e.server_process import ServerProcess  # noqa: E402


@dataclass
class Result:
    kind: str  # short | long
    ok: bool
    ttft: float
    e2e: float
    tokens: int
    replica: str
    error: str = ""


@dataclass
class Row:
    policy: str
    completed: int
    failed: int
    seconds: float
    out_tok_per_s: float
    ttft_p50: float
    ttft_p99: float
    short_ttft_p99: float
    long_ttft_p99: float
    hit_rate: float
    split: dict


def documents(tag: str, n_docs: int, words: int) -> list[str]:
    text = CORPUS.read_text().split()
    rng = random.Random(tag)
    docs = []
    for i in range(n_docs):
        start = rng.randrange(0, max(1, len(text) - words))
        docs.append(f"[{tag} document {i}] " + " ".join(text[start:start + words]))
    return docs


def workload(tag: str, n: int, seed: int, long_words: int) -> list[tuple[str, list[dict]]]:
    rng = random.Random(seed)
    docs = documents(tag, 4, long_words)
    out = []
    for i in range(n):
        if rng.random() < 0.2:
            doc = rng.choice(docs)
            out.append(("long", [{"role": "system", "content": f"Answer from this document.\n{doc}"},
                                 {"role": "user", "content": f"Question {i}: what is the main point?"}]))
        else:
            out.append(("short", [{"role": "user", "content": f"[{tag}] Tell me a short fact, number {i}."}]))
    return out


async def send(http: httpx.AsyncClient, url: str, kind: str, messages: list[dict], max_tokens: int) -> Result:
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens, replica = 0.0, 0, ""
    try:
        async with http.stream("POST", url, json=body) as r:
            replica = r.headers.get("x-ferrylm-upstream", "")
            if r.status_code != 200:
                await r.aread()
                return Result(kind, False, 0.0, time.perf_counter() - start, 0, replica,
                              f"{r.status_code} {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(kind, False, 0.0, time.perf_counter() - start, 0, replica, str(data["error"]))
                if not ttft and any((c.get("delta") or {}).get("content") for c in data.get("choices") or []):
                    ttft = time.perf_counter() - start
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Result(kind, False, 0.0, time.perf_counter() - start, 0, replica, f"{type(e).__name__}: {e}")
    return Result(kind, tokens > 0, ttft, time.perf_counter() - start, tokens, replica)


async def run_load(url: str, items, rate: float, max_tokens: int, seed: int) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        tasks, start = [], time.perf_counter()
        for kind, messages in items:
            tasks.append(asyncio.create_task(send(http, url, kind, messages, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def prefix_counters(replicas) -> tuple[float, float]:
    ms = [r.metrics() for r in replicas]
    return (sum(m["ferrylm:prefix_cache_hits_total"] for m in ms),
            sum(m["ferrylm:prefix_cache_queries_total"] for m in ms))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_policy(policy: str, args) -> tuple[Row, list[Result]]:
    """Fresh replicas for each policy, so no policy inherits another's warm prefix caches."""
    replicas = [ServerProcess("--no-gateway", *args.replica_args.split()) for _ in range(2)]
    try:
        for r in replicas:
            r.wait_ready()
        return _run_policy(policy, replicas, args)
    finally:
        for r in replicas:
            r.stop()


def _run_policy(policy: str, replicas, args) -> tuple[Row, list[Result]]:
    upstreams = [a for r in replicas for a in ("--upstream", r.base_url)]
    gw = ServerProcess(*upstreams, "--policy", policy, "--no-gateway", "--expose-upstream-header", command="gateway")
    gw.wait_ready(120)
    try:
        for r in replicas:
            r.wait_idle(120)
        hits0, queries0 = prefix_counters(replicas)
        items = workload("bench", args.num_requests, args.seed, args.long_words)
        results, seconds = asyncio.run(run_load(gw.url("/v1/chat/completions"), items, args.rate,
                                                args.max_tokens, args.seed))
        hits1, queries1 = prefix_counters(replicas)
    finally:
        gw.stop()
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"[{policy}: failed {r.kind} request: {r.error}]", file=sys.stderr)
    names = {r.base_url: f"r{i}" for i, r in enumerate(replicas)}
    split = {names.get(u, u): sum(1 for r in results if r.replica == u) for u in sorted({r.replica for r in results})}
    row = Row(policy, len(ok), len(results) - len(ok), seconds, sum(r.tokens for r in ok) / seconds,
              pct([r.ttft for r in ok], 50), pct([r.ttft for r in ok], 99),
              pct([r.ttft for r in ok if r.kind == "short"], 99), pct([r.ttft for r in ok if r.kind == "long"], 99),
              (hits1 - hits0) / max(1.0, queries1 - queries0), split)
    return row, results


def print_table(rows: list[Row]) -> None:
    head = (f"{'policy':26} {'ok':>4} {'fail':>4} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'short p99':>9} {'long p99':>9} {'hit rate':>8}  split")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.policy:26} {r.completed:4d} {r.failed:4d} {r.out_tok_per_s:9.1f} {r.ttft_p50:9.3f} "
              f"{r.ttft_p99:9.3f} {r.short_ttft_p99:9.3f} {r.long_ttft_p99:9.3f} {r.hit_rate:8.1%}  {r.split}")


def plot(rows: list[Row], results: dict[str, list[Result]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy, res in results.items():
        ttfts = sorted(r.ttft for r in res if r.ok)
        a.plot(ttfts, np.linspace(0, 1, len(ttfts)), label=policy)
    a.set_xlabel("TTFT (s)"), a.set_ylabel("fraction of requests"), a.set_title("TTFT CDF"), a.legend()
    x = np.arange(len(rows))
    b.bar(x - 0.2, [r.ttft_p99 for r in rows], 0.4, label="p99 TTFT (s)")
    b.bar(x + 0.2, [r.long_ttft_p99 for r in rows], 0.4, label="p99 TTFT long prompts (s)")
    b.set_xticks(x, [r.policy for r in rows], fontsize=8), b.legend(), b.set_title("tail TTFT")
    c.bar(x - 0.2, [r.out_tok_per_s for r in rows], 0.4, label="output tok/s")
    c2 = c.twinx()
    c2.bar(x + 0.2, [100 * r.hit_rate for r in rows], 0.4, color="tab:green", label="prefix hit rate (%)")
    c.set_xticks(x, [r.policy for r in rows], fontsize=8), c.set_title("throughput | prefix-cache hit rate (green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--long-words", type=int, default=700, help="words per long document (~1,000 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replica-args", default="--max-num-seqs 32 --max-num-batched-tokens 512")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.long_words, args.seed = 20, 200, 1
    OUT.mkdir(exist_ok=True)
    rows, results = [], {}
    for policy in POLICIES:
        row, res = run_policy(policy, args)
        rows.append(row)
        results[policy] = res
        print(f"[{policy}: done in {row.seconds:.0f}s]", file=sys.stderr)
    print(f"\n2 replicas, {args.num_requests} requests (80% short chats, 20% ~{args.long_words}-word documents, "
          f"4 distinct), Poisson {args.rate} req/s, max_tokens {args.max_tokens}")
    print_table(rows)
    (OUT / "router.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    plot(rows, results, OUT / "router.png")
    print(f"plot: {OUT / 'router.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
