"""What one abusive client costs the others (M2.1), side by side: this tree's `ferrylm serve` and
the same server at an older commit (default: before M2.1), run alternately in one session.

Each scenario runs a victim stream (chat, 160 tokens, greedy) while an attacker sends:
  huge      a chat message of ~3.9 MB (just under --max-body-bytes)
  fanout    /v1/completions with prompt ["hi"] * 2000 and n = 8 (16,000 sequences)
  slow      a stream with n = 8, logprobs = 20, max_tokens = 2000 whose reader never reads (40 s)
and reports the victim's longest gap between tokens, the attacker's answer, and the server's RSS
growth. The CPU check reads /proc/stat: the share of busy CPU time not spent by the server or this
script during the timed window (should be ~0 on a quiet machine).

    .venv/bin/python bench/abuse.py [--ref 61c5eac] [--scenarios huge,fanout,slow]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.e2e.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def busy_jiffies() -> int:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def process_jiffies(pid: int) -> int:
    """utime + stime of `pid` and its reaped children (threads included)."""
    parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(parts[i]) for i in (11, 12, 13, 14))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class CpuWindow:
    """Busy CPU time on the machine vs. the server's and ours, over a `with` block."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self) -> "CpuWindow":
        self.t0, self.ours0 = busy_jiffies(), process_jiffies(self.pid) + process_jiffies(os.getpid())
        return self

    def __exit__(self, *exc) -> None:
        busy = busy_jiffies() - self.t0
        ours = process_jiffies(self.pid) + process_jiffies(os.getpid()) - self.ours0
        self.other_share = max(0.0, (busy - ours) / busy) if busy else 0.0


async def victim(base: str, started: asyncio.Event) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "temperature": 0, "max_tokens": 160, "ignore_eos": True, "stream": True}
    gaps, last, tokens = [], None, 0
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last, tokens = now, tokens + 1
                    if tokens == 5:
                        started.set()
    gaps.sort()
    return {"tokens": tokens, "max_gap_s": gaps[-1] if gaps else None,
            "p50_gap_s": gaps[len(gaps) // 2] if gaps else None}


async def attack_huge(base: str) -> str:
    content = "word " * (3_900_000 // 5)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": content}]})
    return f"{r.status_code} in {time.monotonic() - t0:.2f} s"


async def attack_fanout(base: str) -> str:
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 2000, "n": 8,
                                                       "max_tokens": 4})
    return f"{r.status_code} in {time.monotonic() - t0:.2f} s"


async def attack_slow(base: str, port: int, seconds: float = 40.0) -> str:
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "n": 8,
                       "ignore_eos": True, "logprobs": 20, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(head + body)
    await asyncio.sleep(seconds)  # never read
    sock.close()
    return f"unread for {seconds:.0f} s"


async def scenario(server: ServerProcess, name: str) -> dict:
    pid = server.proc.pid
    rss0 = rss_mb(pid)
    with CpuWindow(pid) as cpu:
        if name == "slow":  # the attacker first, then a victim while the server holds its backlog
            attack = asyncio.create_task(attack_slow(server.base_url, server.port))
            await asyncio.sleep(20)
            peak = rss_mb(pid)
            started = asyncio.Event()
            result = await victim(server.base_url, started)
            answer = await attack
            peak = max(peak, rss_mb(pid))
        else:
            started = asyncio.Event()
            victim_task = asyncio.create_task(victim(server.base_url, started))
            await started.wait()
            answer = await (attack_huge(server.base_url) if name == "huge" else attack_fanout(server.base_url))
            result = await victim_task
            peak = rss_mb(pid)
    server.wait_idle(600)
    return {"scenario": name, **result, "attacker": answer, "rss_growth_mb": round(peak - rss0, 1),
            "other_cpu_share": round(cpu.other_share, 3)}


def start(tree: Path) -> ServerProcess:
    server = ServerProcess("--model", MODEL, "--no-gateway", cwd=str(tree))
    server.wait_ready(600)
    return server


def worktree(ref: str) -> Path:
    path = ROOT / "bench" / ".peers" / f"ferrylm-{ref}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                       capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="61c5eac", help="the older commit to compare with")
    ap.add_argument("--scenarios", default="huge,fanout,slow")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trees = {"this tree": ROOT, f"at {args.ref}": worktree(args.ref)}
    rows = []
    for name in args.scenarios.split(","):
        for label, tree in trees.items():  # alternate, one server at a time
            server = start(tree)
            try:
                rows.append({"server": label, **asyncio.run(scenario(server, name))})
            finally:
                server.stop()
            print(json.dumps(rows[-1]), flush=True)
    cols = ["scenario", "server", "attacker", "tokens", "p50_gap_s", "max_gap_s", "rss_growth_mb", "other_cpu_share"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
