"""Anthropic Messages streaming against chat completions streaming on the same server, prompt and
greedy settings: time to first token and inter-token latency (p50), alternating requests, one at a
time. The goal (issue M3.5): Messages within 5% of chat. Prints a table, the CPU and the CPU share
anything else used (/proc/stat; the server process is ours).

    .venv/bin/python bench/messages_vs_chat.py [--requests 12] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import CpuWindow, describe_cpu  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
PROMPT = "Describe, in a few sentences, how a ferry crosses a wide river against the current."


def _timed(client: httpx.Client, url: str, body: dict, is_token) -> tuple[float, list[float]]:
    """(TTFT, gaps between tokens) of one streamed request, read event by event."""
    start = time.perf_counter()
    times = []
    with client.stream("POST", url, json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                if is_token(json.loads(line[5:])):
                    times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]


def _chat_token(event: dict) -> bool:
    return bool(event.get("choices") and event["choices"][0].get("delta", {}).get("content"))


def _messages_token(event: dict) -> bool:
    return event.get("type") == "content_block_delta" and bool(event.get("delta", {}).get("text"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    server = ServerProcess("--model", MODEL)  # eager: this compares the two APIs, not the engine
    try:
        server.wait_ready(600)
        chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True}
        messages = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": True}
        sides = {"chat": ([], []), "messages": ([], [])}
        with httpx.Client() as client, CpuWindow(server.proc.pid) as window:
            for _ in range(2):  # warm both paths
                _timed(client, server.url("/v1/chat/completions"), chat, _chat_token)
                _timed(client, server.url("/v1/messages"), messages, _messages_token)
            for _ in range(args.requests):
                for name, url, body, is_token in (("chat", "/v1/chat/completions", chat, _chat_token),
                                                  ("messages", "/v1/messages", messages, _messages_token)):
                    ttft, gaps = _timed(client, server.url(url), body, is_token)
                    sides[name][0].append(ttft)
                    sides[name][1].extend(gaps)
        print(f"CPU: {describe_cpu()}; foreign CPU {window.foreign_share:.3f}")
        print(f"{args.requests} requests per API, alternating, one at a time, {args.max_tokens} tokens, greedy")
        print("| API | TTFT p50 (ms) | ITL p50 (ms) |\n|---|---:|---:|")
        for name, (ttfts, gaps) in sides.items():
            print(f"| {name} | {statistics.median(ttfts) * 1000:.1f} | {statistics.median(gaps) * 1000:.2f} |")
        (ct, cg), (mt, mg) = sides["chat"], sides["messages"]
        print(f"messages / chat: TTFT {statistics.median(mt) / statistics.median(ct):.3f}x, "
              f"ITL {statistics.median(mg) / statistics.median(cg):.3f}x")
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
