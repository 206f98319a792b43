"""`ferrylm serve`'s default start on an empty compile cache, timed from outside: seconds to the port
listening, to /ready, to the first answered completion, and until the background compile logs its
decode graphs done. The C++ kernels are prebuilt (`make setup` builds them, as an install would).

    .venv/bin/python bench/cold_start.py [--rounds 2]

Prints one row per round and the CPU it ran on; a round that shared the CPU with another process
is flagged (/proc/stat).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import CpuWindow, describe_cpu  # noqa: E402
from tests.e2e.server_process import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"


def one_round(timeout: float) -> dict[str, float]:
    """Start serve on an empty FERRYLM_CACHE_DIR; the moments (s since start) of each milestone."""
    with tempfile.TemporaryDirectory() as cache:
        start = time.monotonic()
        server = ServerProcess("--model", MODEL, eager=False, env={"FERRYLM_CACHE_DIR": cache})
        marks: dict[str, float] = {}
        try:
            with CpuWindow(server.proc.pid) as window:
                server.wait_ready(timeout)
                marks["ready"] = time.monotonic() - start
                r = httpx.post(server.url("/v1/completions"), timeout=timeout, json={
                    "model": MODEL, "prompt": "The sea is", "max_tokens": 8, "temperature": 0})
                r.raise_for_status()
                marks["first answer"] = time.monotonic() - start
                deadline = start + timeout
                while "compiled decode step in" not in server.log_path.read_text(errors="replace"):
                    if time.monotonic() > deadline or server.proc.poll() is not None:
                        break
                    time.sleep(0.5)
                else:
                    marks["graphs compiled"] = time.monotonic() - start
            marks["foreign CPU"] = window.foreign_share
        finally:
            server.kill()  # its compile workers too
        return marks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu}")
    print("| round | ready (s) | first answer (s) | decode graphs compiled (s) | foreign CPU |")
    print("|---|---|---|---|---|")
    for i in range(args.rounds):
        m = one_round(args.timeout)
        graphs = f"{m['graphs compiled']:.1f}" if "graphs compiled" in m else "not within the timeout"
        print(f"| {i + 1} | {m['ready']:.1f} | {m['first answer']:.1f} | {graphs} | {m['foreign CPU']:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
