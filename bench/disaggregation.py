"""Disaggregated prefill/decode vs co-located, in one run: the inter-token latency of ongoing streams
while long prompts (~4k tokens) arrive.

    .venv/bin/python bench/disaggregation.py [--streams 4] [--long 3] [--long-tokens 4000]

Co-located: one `ferrylm serve` on both cores takes the streams and the long prompts. Disaggregated:
`ferrylm gateway --policy disaggregated` in front of a prefill replica pinned to core 0 and a decode
replica pinned to core 1 (taskset, one thread each); streams and long prompts both go through it, so
every prompt is prefilled on core 0 and its KV blocks imported by the decode replica. The streams'
chunk arrival gaps are the ITL; p50 / p99 / max over the window in which the long prompts arrive.
Each run reads /proc/stat: the CPU used by anything but this run's own processes. Results:
bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_check import ForeignCpu  # noqa: E402
from tests.e2e.server_process import free_port  # noqa: E402

MODEL = "smollm2-135m"
WORDS = ("harbour", "rope", "gull", "tide", "lantern", "keel", "mast", "reef", "anchor", "compass")


class Proc:
    """A ferrylm process (serve or gateway), optionally pinned to CPUs with taskset."""

    def __init__(self, args: list[str], cpus: str | None = None, threads: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "ferrylm.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        env = {**__import__("os").environ, **({"FERRYLM_CPU_THREADS": str(threads)} if threads else {})}
        self.log = tempfile.NamedTemporaryFile(prefix="ferrylm-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not ready; log {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


async def stream(client: httpx.AsyncClient, url: str, topic: str, max_tokens: int, gaps: list[tuple[float, float]]):
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell a long story about the {topic}."}]}
    last = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def long_prompt(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> None:
    text = " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(tokens))  # ~1 token a word
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"Log {i}. Summarize: {text}"}]}
    r = await client.post(url + "/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"long prompt {i}: {r.status_code} {r.text[:300]}")


async def scenario(url: str, streams: int, longs: int, long_tokens: int, max_tokens: int) -> dict:
    gaps: list[tuple[float, float]] = []
    async with httpx.AsyncClient() as client:
        tasks = [asyncio.create_task(stream(client, url, WORDS[i], max_tokens, gaps)) for i in range(streams)]
        await asyncio.sleep(3.0)  # the streams are decoding
        window_start = time.monotonic()
        for i in range(longs):
            await long_prompt(client, url, i, long_tokens)
        window_end = time.monotonic()
        await asyncio.gather(*tasks)
    during = np.array([g for t, g in gaps if window_start <= t <= window_end] or [float("nan")]) * 1000
    return {"p50": float(np.percentile(during, 50)), "p99": float(np.percentile(during, 99)),
            "max": float(during.max()), "n": len(during), "window_s": window_end - window_start}


def run(label: str, procs: list[Proc], url: str, args) -> dict:
    for p in procs:
        p.wait_ready()
    asyncio.run(scenario(url, 1, 1, 256, 16))  # warm-up: compile caches, first transfer
    with ForeignCpu(exclude_pids=[p.proc.pid for p in procs] + _children(procs)) as cpu:
        result = asyncio.run(scenario(url, args.streams, args.long, args.long_tokens, args.max_tokens))
    for p in procs:
        p.stop()
    result["foreign"] = cpu.share
    print(label, result, flush=True)
    return result


def _children(procs: list[Proc]) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid in {p.proc.pid for p in procs}:
            pids.append(int(stat.parent.name))
    return pids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args()
    common = ["--max-model-len", "8192", "--max-num-batched-tokens", "512"]
    colocated = Proc(["serve", *common])
    co = run("co-located", [colocated], colocated.url, args)
    prefill = Proc(["serve", *common, "--kv-role", "prefill"], cpus="0", threads=1)
    decode = Proc(["serve", *common, "--kv-role", "decode"], cpus="1", threads=1)
    prefill.wait_ready()
    decode.wait_ready()
    gateway = Proc(["gateway", "--upstream", decode.url, "--prefill-upstream", prefill.url, "--policy",
                    "disaggregated", "--no-gateway"], cpus="1")
    dis = run("disaggregated", [prefill, decode, gateway], gateway.url, args)
    print(f"\n{args.streams} streams (max_tokens {args.max_tokens}) decoding while {args.long} prompts of "
          f"~{args.long_tokens} tokens arrive one after another; ITL of the streams in that window\n")
    print("| setup | ITL p50 ms | ITL p99 ms | ITL max ms | gaps | window s | foreign CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in (("co-located (1 replica, 2 cores)", co),
                     ("disaggregated (prefill core 0, decode core 1, gateway)", dis)):
        print(f"| {label} | {r['p50']:.1f} | {r['p99']:.1f} | {r['max']:.1f} | {r['n']} | {r['window_s']:.1f} "
              f"| {r['foreign']:.1%} |")


if __name__ == "__main__":
    main()
