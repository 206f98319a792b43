"""A real `ferrylm serve` subprocess on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts the server (or, with command="gateway", a gateway) at construction; `wait_ready`
    polls /ready; logs go to a temp file. `port` reuses a port (a replica restarted in place).
    `eager=False` keeps serve's default compiled decode step (tests add --enforce-eager otherwise)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, api_key: str | None = None,
                 command: str = "serve", port: int | None = None, cwd: str | None = None, eager: bool = True):
        self.port = port or free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="ferrylm-e2e-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "ferrylm.cli", command, "--host", "127.0.0.1", "--port", str(self.port), *args]
        if command == "serve" and eager and not any(a.endswith("enforce-eager") for a in args):
            cmd.append("--enforce-eager")  # a compiled decode step costs each server seconds to minutes at start
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = self.log_path.open("wb")
        base_env = {k: v for k, v in os.environ.items() if k not in ("FERRYLM_API_KEY", "FERRYLM_TEST_HOOKS")}
        # a session of its own: kill() reaches its children too (inductor's compile workers)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**base_env, **(env or {})},
                                     cwd=cwd, start_new_session=True)  # `python -m` imports ferrylm from cwd first

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/ready"), timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url("/v1"), api_key=api_key or self.api_key or "unused", max_retries=0,
                             timeout=120)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", max_retries=0,
                                  timeout=300)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels other than model_name folded into the name)."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
        return values

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Wait until no request is running or waiting; returns the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["ferrylm:num_requests_running"] == 0 and m["ferrylm:num_requests_waiting"] == 0:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {m}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server and every process it started: a killed server's inductor compile workers
        otherwise live on, and spun a core through whatever ran next."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(60)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def make_keys(db_url: str, tenants: dict[str, dict]) -> dict[str, str]:
    """Tenants (name → create_tenant kwargs) and one key each, written straight to the state DB."""
    from ferrylm.gateway.store import Store  # imported here: most tests never need the state DB

    store = Store(db_url, time.time)
    try:
        keys = {}
        for name, kwargs in tenants.items():
            store.create_tenant(name, **kwargs)
            keys[name] = store.create_key(name)[1]
        return keys
    finally:
        store.close()
