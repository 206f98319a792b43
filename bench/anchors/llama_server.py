"""llama.cpp's llama-server as a worker engine: sequences decoded in parallel (continuous batching).

llama-cpp-python's Llama holds one sequence, so the `llamacpp` engine runs batches one request after
another; llama-server holds --parallel slots and batches them into each decode step. The worker starts
the server (bench/.peers/llama-server-*/build/bin/llama-server, built by peers.build_server) on a free
loopback port, waits for /health, and sends every request's exact token ids to /completion (greedy,
ignore_eos, no prompt cache), concurrently from threads. Standard library only (it runs under FerryLM's
venv Python); the server goes down with the worker (atexit, and PR_SET_PDEATHSIG if the worker is killed).

    python bench/anchors/llama_server.py --server PATH/llama-server --model GGUF   # the probe (peers.py runs it)

The probe starts the server with 2 slots and trace logging (`-lv 4`: the only level that prints
system_info, the CPU features the build uses), runs two short requests at once and prints the server's
info as JSON: exit status 0 means the build's extra buffer types (AMX, repacked weights) work on this
CPU. peers.server_extra_buffers_work stamps it next to the build; the worker adds its system_info to its
own info from there (the benchmark's server runs at the default log level).
"""

from __future__ import annotations

import atexit
import ctypes
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SLOTS = 64  # as max_num_seqs=64 for FerryLM and vLLM
PROBE_STAMP = ".extra-buffers-probe"  # in bench/.peers/<build>/, the server being <build>/build/bin/llama-server
SLOT_CTX = 1024  # per slot (llama-server divides --ctx-size among them): 512-token prompts + 256 out, and margin
HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's child process: SIGTERM when the worker dies, however it dies (Linux only)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LlamaServerEngine:
    """One llama-server process with SLOTS parallel slots; requests over HTTP on loopback."""

    def __init__(self, model: str, quantization: str, extra_buffers: bool = True, server: str | None = None,
                 threads: int | None = None, slots: int = SLOTS, verbosity: int | None = None):
        if not server or not Path(server).exists():
            raise RuntimeError(f"llama-server binary not found: {server!r} (python bench/anchors/peers.py "
                               "llamaserver,llamaserver-avx2 builds it)")
        # all CPUs, as the llamacpp engine; LLAMA_SERVER_THREADS overrides (llama.cpp's threads meet at a
        # barrier every op: on a busy 2-CPU box, 2 threads decode far slower than 1)
        self.threads = threads or int(os.environ.get("LLAMA_SERVER_THREADS", 0)) or os.cpu_count() or 1
        self.port = _free_port()
        cmd = [server, "--model", model, "--host", HOST, "--port", str(self.port),
               "--parallel", str(slots), "--cont-batching", "--ctx-size", str(slots * SLOT_CTX),
               "--threads", str(self.threads), "--threads-batch", str(self.threads),
               "--cache-ram", "0",  # no host-memory prompt cache: every request prefills in full, as cache_prompt=false
               "--no-webui", "--seed", "0"]
        if verbosity is not None:
            cmd += ["--log-verbosity", str(verbosity)]
        if not extra_buffers:
            cmd.append("--no-repack")  # llama-server's switch for extra buffer types (AMX, repacked weights)
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        self.log: list[str] = []  # the server's startup lines, kept for info (system_info, n_ctx_seq, ...)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace", preexec_fn=_die_with_parent)
        atexit.register(self.close)
        threading.Thread(target=self._tee, daemon=True).start()
        self._wait_healthy(timeout_s=600)
        self.info = {"dtype": "GGUF Q4_1 (as shipped)", "server": server, "threads": self.threads, "slots": slots,
                     "ctx_size": slots * SLOT_CTX, "extra_buffers": extra_buffers, **self._startup_info()}
        probe = Path(server).resolve().parents[2] / PROBE_STAMP
        if "system_info" not in self.info and probe.exists():  # from the probe's run of the same binary
            probed = json.loads(probe.read_text()).get("info", {})
            self.info |= {k: probed[k] for k in ("system_info", "build") if k in probed}

    # --- process ---------------------------------------------------------------------------------------

    def _tee(self) -> None:
        """The server's output into the worker's stderr (its log); the first lines also kept for info."""
        assert self.proc.stdout
        for line in self.proc.stdout:
            if len(self.log) < 2000:
                self.log.append(line.rstrip("\n"))
            sys.stderr.write("[llama-server] " + line)
            sys.stderr.flush()

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the tee thread catch the last lines
                tail = "\n".join(self.log[-30:])
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) while loading:\n{tail}")
            try:
                status, _ = self._request("GET", "/health", None, timeout=5)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f} s")

    def _startup_info(self) -> dict:
        """What the server says about itself: build, CPU features (system_info), per-slot context."""
        out: dict = {}
        patterns = {"build": r"common_params_print_info: build (.+)", "n_ctx_seq": r"n_ctx_(?:seq|slot)\s*=\s*(\d+)",
                    "kv_unified": r"kv_unified\s*=\s*'?(\w+)"}
        for line in self.log:
            if "system_info:" in line:  # "n_threads = 2 ... | CPU : SSE3 = 1 | ... | AVX2 = 1 | ... | AVX512 = 1 | ..."
                out.setdefault("system_info", line.split("system_info:", 1)[1].strip())
            for key, pattern in patterns.items():
                if key not in out and (m := re.search(pattern, line)):
                    out[key] = m.group(1).strip()
        if "n_ctx_seq" in out:
            out["n_ctx_seq"] = int(out["n_ctx_seq"])
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # --- HTTP ------------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None, timeout: float = 3600) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else {}
        finally:
            conn.close()

    @staticmethod
    def _body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
        # Greedy: top_k=1 as the only sampler (temperature 0 alone would still run the default chain).
        return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "samplers": ["top_k"],
                "ignore_eos": True, "cache_prompt": False, "stream": stream, "return_tokens": True, "seed": 0,
                "repeat_penalty": 1.0}

    def _complete(self, prompt: list[int], max_tokens: int) -> dict:
        status, reply = self._request("POST", "/completion", self._body(prompt, max_tokens, stream=False))
        if status != 200:
            raise RuntimeError(f"llama-server /completion: HTTP {status}: {reply}")
        return reply

    # --- the worker's Engine protocol ------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        """All requests submitted at once (one connection each); the server batches them into its slots."""
        if len(prompts) == 1:
            return int(self._complete(prompts[0], max_tokens[0])["tokens_predicted"])
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            replies = list(pool.map(self._complete, prompts, max_tokens))
        return sum(int(r["tokens_predicted"]) for r in replies)

    def stream(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """stream=true: one SSE event per sent token; each token's arrival time (events counted by
        tokens_predicted, since the server holds back a token that ends inside a UTF-8 character)."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=3600)
        ids: list[int] = []
        times: list[float] = []
        try:
            conn.request("POST", "/completion", body=json.dumps(self._body(prompt, max_tokens, stream=True)),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"llama-server /completion (stream): HTTP {resp.status}: {resp.read()[:2000]!r}")
            n = 0
            while line := resp.readline():
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"llama-server /completion (stream): {event['error']}")
                decoded = int(event.get("tokens_predicted", n))
                ids += event.get("tokens") or []
                times += [now] * (decoded - n)
                n = max(n, decoded)
                if event.get("stop"):
                    break
        finally:
            conn.close()
        if len(ids) != len(times):  # a held-back token's id never came: the same greedy request, unstreamed
            ids = list(self._complete(prompt, max_tokens)["tokens"])
        return ids, times

    def reset_cache(self) -> None:
        """Nothing to forget: every request has cache_prompt=false (and --cache-ram 0), so it prefills in full."""


def probe() -> int:
    """Two short requests at once on a 2-slot server with extra buffer types on; info as JSON on stdout."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        engine = LlamaServerEngine(args.model, "none", True, server=args.server, slots=2, verbosity=4)
        prompts = [[1000 + (i * 7 + j) % 20000 for j in range(64)] for i in range(2)]
        n = engine.generate(prompts, [4, 4])
        alive = engine.proc.poll() is None
        engine.close()
    except Exception:
        traceback.print_exc()
        return 1
    out.write(json.dumps({"tokens": n, "info": engine.info}) + "\n")
    return 0 if n == 8 and alive else 1


if __name__ == "__main__":
    sys.exit(probe())
