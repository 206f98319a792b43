"""What the standalone gateway's extra hop costs: the same requests sent straight to a replica and
through `ferrylm gateway` (no auth, so only proxying, tokenizing and routing are measured),
interleaved request by request so the machine's noise hits both alike. Short and ~1,000-token
prompts (the gateway tokenizes and hashes every prompt), non-streamed and streamed (TTFT).

    .venv/bin/python bench/proxy_overhead.py            # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(__file__).with_name("out")
CORPUS = Path(__file__).with_name("corpus.txt")

from tests.e2e.server_process import ServerProcess  # noqa: E402


def timed(http: httpx.Client, url: str, messages: list[dict], stream: bool) -> float:
    """Seconds to the whole answer (stream off) or to the first content chunk (stream on)."""
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 1 if not stream else 4,
            "temperature": 0, "stream": stream}
    start = time.perf_counter()
    if not stream:
        r = http.post(url, json=body)
        r.raise_for_status()
        return time.perf_counter() - start
    with http.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                return time.perf_counter() - start
    raise RuntimeError("stream without content")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=150, help="timed requests per path and scenario")
    p.add_argument("--long-words", type=int, default=700)
    args = p.parse_args(argv)
    words = CORPUS.read_text().split()
    long_doc = " ".join(words[:args.long_words])
    scenarios = {"short, JSON": ([{"role": "user", "content": "Hi there"}], False),
                 "short, stream (TTFT)": ([{"role": "user", "content": "Hi there"}], True),
                 "~1k-token prompt, JSON": ([{"role": "system", "content": long_doc},
                                             {"role": "user", "content": "Summarise."}], False)}
    replica = ServerProcess("--no-gateway", "--max-num-seqs", "8")
    replica.wait_ready()
    gateway = ServerProcess("--upstream", replica.base_url, "--no-gateway", command="gateway")
    gateway.wait_ready(120)
    rows = []
    try:
        paths = {"direct": replica.url("/v1/chat/completions"), "gateway": gateway.url("/v1/chat/completions")}
        rng = random.Random(0)
        with httpx.Client(timeout=120) as http:
            for name, (messages, stream) in scenarios.items():
                for url in paths.values():  # warm-up (and the prefix cache, for both paths alike)
                    for _ in range(5):
                        timed(http, url, messages, stream)
                times = {k: [] for k in paths}
                order = [k for k in paths for _ in range(args.n)]
                rng.shuffle(order)
                for k in order:
                    times[k].append(timed(http, paths[k], messages, stream))
                d, g = (np.array(times[k]) * 1000 for k in ("direct", "gateway"))
                rows.append({"scenario": name, "direct_p50": float(np.percentile(d, 50)),
                             "gateway_p50": float(np.percentile(g, 50)), "direct_p99": float(np.percentile(d, 99)),
                             "gateway_p99": float(np.percentile(g, 99))})
    finally:
        gateway.stop()
        replica.stop()
    print(f"\nferrylm gateway hop vs direct to the replica, {args.n} interleaved requests per path and scenario (ms)")
    head = (f"{'scenario':24} {'direct p50':>10} {'gateway p50':>11} {'+p50':>7} "
            f"{'direct p99':>10} {'gateway p99':>11} {'+p99':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['scenario']:24} {r['direct_p50']:10.1f} {r['gateway_p50']:11.1f} "
              f"{r['gateway_p50'] - r['direct_p50']:+7.1f} {r['direct_p99']:10.1f} {r['gateway_p99']:11.1f} "
              f"{r['gateway_p99'] - r['direct_p99']:+7.1f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "proxy_overhead.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
