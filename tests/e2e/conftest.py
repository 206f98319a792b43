"""End-to-end fixtures: one shared float32 server for the API tests (started while the offline LLM
used for expectations loads in this process, so the two loads overlap)."""

from __future__ import annotations

import pytest

from tests.e2e.server_process import ServerProcess

# The offline fixture `llm_fp32` uses these settings too, so batches are shaped alike.
API_SERVER_ARGS = ("--model", "smollm2-135m", "--dtype", "float32", "--max-num-seqs", "64",
                   "--max-num-batched-tokens", "1024")


@pytest.fixture(scope="session")
def _api_server_process():
    server = ServerProcess(*API_SERVER_ARGS)
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log_tail()}"


@pytest.fixture(scope="session")
def api_server(_api_server_process: ServerProcess, llm_fp32) -> ServerProcess:
    """The shared server, ready. Requesting `llm_fp32` here loads it while the server loads."""
    _api_server_process.wait_ready()
    return _api_server_process


@pytest.fixture(scope="session")
def client(api_server: ServerProcess):
    return api_server.client()
