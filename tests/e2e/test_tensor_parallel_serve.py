"""`ferrylm serve --tensor-parallel-size 2` end to end: chat through the official client equals the
offline float32 answer, streamed and not; when a rank is SIGKILLed the server says so (/health 503,
a request fails with an explicit error, never a hang) and stops cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from ferrylm import SamplingParams
from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2
MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_tp2_server_answers_then_reports_a_killed_rank(llm_fp32):
    server = ServerProcess("--dtype", "float32", "--tensor-parallel-size", "2", "--max-num-seqs", "8")
    try:
        server.wait_ready()
        client = server.client()
        expected = llm_fp32.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24)
        assert reply.choices[0].message.content == expected.outputs[0].text
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.outputs[0].text
        ranks = [pid for pid in _children(server.proc.pid)
                 if b"ferrylm.model.parallel.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(server.url("/health"), timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the rank died"
            time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
        assert failed.value.status_code >= 500 and time.monotonic() - started < 30
        assert "tensor-parallel rank 1" in server.log_tail(200)
    finally:
        server.stop()


def test_torchrun_launches_the_ranks_and_rank_0_serves(llm_fp32, tmp_path):
    """`torchrun --nproc-per-node 2 -m ferrylm.cli serve -tp 2`: every process runs the same command,
    rank 0 serves HTTP, rank 1 joins its group (in torchrun's store at MASTER_PORT) and runs its steps."""
    import subprocess
    import sys

    from tests.e2e.server_process import free_port

    port, master = free_port(), free_port()
    log = tmp_path.joinpath("torchrun.log").open("w")
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.Popen([str(torchrun), "--nproc-per-node", "2", "--master-port", str(master), "-m",
                             "ferrylm.cli", "serve", "-tp", "2", "--dtype", "float32", "--enforce-eager",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"torchrun exited ({proc.poll()}) or never got ready: {Path(log.name).read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        body = {"model": MODEL, "prompt": "The sea is", "max_tokens": 12, "temperature": 0}
        got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        expected = llm_fp32.generate("The sea is", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        assert got["choices"][0]["text"] == expected.outputs[0].text
    finally:
        proc.terminate()
        proc.wait(30)
