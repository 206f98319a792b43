"""Idle and slow clients against real `ferrylm serve` and `ferrylm gateway` processes: a request
head dribbled a header at a time (slowloris) or never sent is cut after --timeout-headers, an
idle keep-alive connection after --timeout-keep-alive, and past --limit-concurrency open
connections a request gets an OpenAI-style 503. Small timeouts keep this quick."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.conftest import requires_smollm2
from tests.e2e.server_process import ServerProcess

pytestmark = requires_smollm2

HEADERS_S, KEEP_ALIVE_S, CAP = 1.5, 1.0, 4
LIMITS = ("--timeout-headers", str(HEADERS_S), "--timeout-keep-alive", str(KEEP_ALIVE_S),
          "--limit-concurrency", str(CAP))


@pytest.fixture(scope="module")
def servers():
    """{"serve": a replica, "gateway": a gateway in front of it}, both with the small limits. The
    gateway polls the replica once at start only, so its connections do not count on the replica."""
    replica = ServerProcess("--no-gateway", "--dtype", "float32", *LIMITS)
    gateway = None
    try:
        replica.wait_ready()
        gateway = ServerProcess("--upstream", replica.base_url, "--no-gateway", "--poll-interval", "60", *LIMITS,
                                command="gateway")
        gateway.wait_ready(60)
        yield {"serve": replica, "gateway": gateway}
    finally:
        for proc in (gateway, replica):
            if proc is not None:
                assert proc.stop() == 0, proc.log_tail()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(0.2)
    return sock


def closed_after(sock: socket.socket, start: float, limit: float, trickle: bytes | None = None) -> float:
    """Seconds from `start` until the server closes `sock` (sending `trickle` every 0.3 s meanwhile)."""
    while time.monotonic() - start < limit:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            if trickle is not None:
                try:
                    sock.sendall(trickle)
                except OSError:  # already reset by the server
                    return time.monotonic() - start
        except ConnectionResetError:
            return time.monotonic() - start
    raise AssertionError(f"connection still open after {limit} s")


@pytest.mark.parametrize("which", ["serve", "gateway"])
def test_slow_request_head_is_cut_after_the_header_timeout(servers, which):
    server = servers[which]
    slow = connect(server)
    start = time.monotonic()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    elapsed = closed_after(slow, start, HEADERS_S + 5, trickle=b"X-Slow: 1\r\n")
    assert HEADERS_S - 0.3 <= elapsed <= HEADERS_S + 2, elapsed
    silent = connect(server)  # connected, never sends a byte
    assert closed_after(silent, time.monotonic(), HEADERS_S + 5) <= HEADERS_S + 2
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


@pytest.mark.parametrize("which", ["serve", "gateway"])
def test_idle_keep_alive_connection_is_closed(servers, which):
    sock = connect(servers[which])
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        try:
            answer += sock.recv(4096)
        except TimeoutError:
            pass
    assert answer.startswith(b"HTTP/1.1 200"), answer
    start = time.monotonic()
    assert KEEP_ALIVE_S - 0.3 <= closed_after(sock, start, KEEP_ALIVE_S + 5) <= KEEP_ALIVE_S + 2
    # A keep-alive request that keeps coming back in time is served each time.
    with httpx.Client(base_url=servers[which].base_url, timeout=10) as client:
        for _ in range(3):
            assert client.get("/health").status_code == 200
            time.sleep(KEEP_ALIVE_S / 3)


@pytest.mark.parametrize("which", ["serve", "gateway"])
def test_past_the_connection_cap_requests_get_a_clean_503(servers, which):
    server = servers[which]
    idle = [connect(server) for _ in range(CAP - 1)]
    time.sleep(0.2)  # accepted by the server
    assert httpx.get(server.url("/v1/models"), timeout=10).status_code == 200  # the CAP-th connection
    idle.append(connect(server))
    time.sleep(0.2)
    r = httpx.get(server.url("/v1/models"), timeout=10)
    assert r.status_code == 503, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["connection"] == "close"
    error = r.json()["error"]
    assert error["code"] == "too_many_connections" and error["type"] == "server_error" and error["message"]
    for sock in idle:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(server.url("/v1/models"), timeout=10).status_code == 200
