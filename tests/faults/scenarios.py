"""The fault scenarios: each drives real `ferrylm serve` / `ferrylm gateway` processes with the real
model, injects one fault, and returns a Ledger of every request it sent. The tests
(tests/faults/test_*.py) run them small; bench/faults.py (`make faults`) runs them at scale.

`scale` multiplies the request counts; `seed` fixes every random choice (where a stream is cut)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.server_process import ServerProcess, free_port, make_keys
from tests.faults.client import MODEL, Result, chat_body, send, stalled_reader
from tests.faults.ledger import Ledger

HOOKS = {"FERRYLM_TEST_HOOKS": "1"}
# One replica sized so that faults bite: 16 sequences, a KV pool of 160 blocks (in blocks, not bytes:
# the default dtype, and so the bytes per block, differ between CPUs) that long outputs overflow, a
# backlog cap of 64 outputs, liveness failing after 2 s of engine silence.
SINGLE_ARGS = ("--model", MODEL, "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
               "--num-gpu-blocks-override", "160", "--max-stream-backlog", "64", "--heartbeat-timeout", "2",
               "--ready-timeout", "2", "--log-level", "warning")
REPLICA_ARGS = ("--model", MODEL, "--no-gateway", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
                "--heartbeat-timeout", "1", "--ready-timeout", "1", "--log-level", "warning")
POLL_INTERVAL_S = 0.25


def start_replica(workdir: Path) -> tuple[ServerProcess, dict[str, str]]:
    """The single-replica scenarios' server (auth on) and keys: `steady` (premium tier) and
    `bulk` (batch tier: a 2 s wait budget, shed first)."""
    db = f"sqlite:///{workdir / 'state.db'}"
    keys = make_keys(db, {"steady": {"tier": "premium"}, "bulk": {"tier": "batch"}})
    server = ServerProcess(*SINGLE_ARGS, "--require-auth", "--state-db", db, env=HOOKS)
    server.wait_ready()
    return server, keys


def spawn_fleet() -> tuple[ServerProcess, list[ServerProcess]]:
    """Two replicas behind a round-robin gateway polling every POLL_INTERVAL_S, all starting at
    once (wait with `wait_all`)."""
    replicas = [ServerProcess(*REPLICA_ARGS, env=HOOKS) for _ in range(2)]
    gateway = ServerProcess("--upstream", replicas[0].base_url, "--upstream", replicas[1].base_url, "--no-gateway",
                            "--policy", "round-robin", "--poll-interval", str(POLL_INTERVAL_S), command="gateway")
    return gateway, replicas


def spawn_limited_gateways(upstream: ServerProcess, workdir: Path) -> tuple[dict[str, ServerProcess], str, int]:
    """Two auth gateways whose tenant limits live in one Redis (not started: the scenario owns
    it), fail-open and fail-closed; (gateways by mode, the tenant's key, the Redis port)."""
    db = f"sqlite:///{workdir / 'state.db'}"
    key = make_keys(db, {"metered": {"rpm": 100_000, "tpm": 10_000_000}})["metered"]
    port = free_port()
    gateways = {mode: ServerProcess("--upstream", upstream.base_url, "--require-auth", "--state-db", db,
                                    "--redis-url", f"redis://127.0.0.1:{port}/0", "--rate-limit-failure-mode", mode,
                                    "--poll-interval", str(POLL_INTERVAL_S), command="gateway")
                for mode in ("open", "closed")}
    return gateways, key, port


def wait_all(servers: list[ServerProcess], gateways: list[ServerProcess]) -> None:
    """Replicas first (a gateway is ready once one of its replicas is)."""
    for server in servers:
        server.wait_ready()
    for gateway in gateways:
        gateway.wait_ready(60)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_and_check(coro: Coroutine[Any, Any, Ledger], report: list[Ledger]) -> Ledger:
    """Run one scenario, add its ledger to the session's report, and assert the guarantee."""
    ledger = asyncio.run(coro)
    report.append(ledger)
    print(ledger.row(), ledger.notes)
    ledger.assert_guarantee()
    return ledger


async def debug_kv(http: httpx.AsyncClient, server: ServerProcess) -> dict:
    return (await http.get(server.url("/debug/kv"), timeout=30)).raise_for_status().json()


async def leaked_blocks(server: ServerProcess, timeout: float = 60.0) -> int:
    """KV blocks still held once the server has nothing running, waiting or swapped out (its
    invariants, host pool included, are checked on the way, between two engine steps)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            kv = await debug_kv(http, server)
            if kv["num_running"] == 0 and kv["num_waiting"] == 0 and kv["num_swapped"] == 0:
                return kv["kv_blocks_used"]
            if time.monotonic() > deadline:
                raise AssertionError(f"{server.base_url} still busy after {timeout}s: {kv}")
            await asyncio.sleep(0.1)


def _record(ledger: Ledger, results: list[Result]) -> list[Result]:
    for r in results:
        ledger.record(r.outcome, r.detail, r.latency_ms)
    return results


def _check_full(ledger: Ledger, results: list[Result], max_tokens: int) -> None:
    """Completed requests that ran with ignore_eos must carry every token they asked for."""
    for r in results:
        if r.outcome == "completed" and r.completion_tokens != max_tokens:
            ledger.counts["completed"] -= 1
            ledger.record("lost", f"completed with {r.completion_tokens} of {max_tokens} tokens")


# -- one replica ------------------------------------------------------------------------------

async def disconnect_storm(server: ServerProcess, key: str, scale: int = 1, seed: int = 0) -> Ledger:
    """Clients hanging up at random points of their streams (before the first byte, after k
    events, or by timing out a non-streamed request), arriving 5 ms apart beside control streams
    that must finish with every token."""
    ledger, rng = Ledger("disconnect storm"), random.Random(seed)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http, \
            httpx.AsyncClient(base_url=server.base_url, timeout=0.3) as short:
        controls = [asyncio.create_task(send(http, "/v1/chat/completions",
                                             chat_body(f"Control {i}", 48, ignore_eos=True), bearer(key)))
                    for i in range(4)]
        jobs: list[asyncio.Task[Result]] = []
        for i in range(28 * scale):
            if i % 7 == 6:
                jobs.append(asyncio.create_task(_timed_out(short, key, i)))
            else:
                cut = rng.choice([0, 1, 2, 3, 5, 8, 13, 21])
                jobs.append(asyncio.create_task(send(
                    http, "/v1/chat/completions", chat_body(f"Story {i}", 64, ignore_eos=True), bearer(key),
                    cancel_after=cut)))
            await asyncio.sleep(0.005)
        results = list(await asyncio.gather(*jobs, *controls))
    _record(ledger, results)
    _check_full(ledger, results[-4:], 48)
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger


async def _timed_out(http: httpx.AsyncClient, key: str, i: int) -> Result:
    """A non-streamed request whose client gives up after 0.3 s (the server must abort it)."""
    r = await send(http, "/v1/chat/completions", chat_body(f"Essay {i}", 256, stream=False, ignore_eos=True),
                   bearer(key))  # send turns the client's timeout into a "lost" result naming it
    return Result("cancelled", "client timeout") if r.outcome == "lost" and "Timeout" in r.detail else r


async def slow_reader(server: ServerProcess, key: str, scale: int = 1) -> Ledger:
    """A client that never reads a fat stream (n=16, 20 logprobs) beside normal streams: the server
    ends the slow one with an explicit error once its backlog passes the cap, the others finish."""
    ledger = Ledger("slow reader")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "n": 16, "ignore_eos": True,
            "logprobs": 20, "stream": True}
    sock = stalled_reader("127.0.0.1", server.port, body, bearer(key), path="/v1/completions")
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
            normal = [send(http, "/v1/chat/completions", chat_body(f"Poem {i}", 64, ignore_eos=True), bearer(key))
                      for i in range(4 * scale)]
            results = await asyncio.gather(*normal)
            _record(ledger, list(results))
            _check_full(ledger, list(results), 64)
            deadline = time.monotonic() + 240  # the kernel's socket buffers fill first
            while (await debug_kv(http, server))["num_running"] > 0:
                if time.monotonic() > deadline:
                    ledger.record("lost", "the slow reader's request was never aborted")
                    return ledger
                await asyncio.sleep(0.2)
        text = await asyncio.to_thread(_drain_socket, sock)
    finally:
        sock.close()
    compact = text.replace(" ", "")
    ok = text.startswith("HTTP/1.1 200") and '"code":"stream_backlog_exceeded"' in compact and "data: [DONE]" in text
    ledger.record("error" if ok else "lost", "" if ok else f"slow stream ended without its error: {text[-300:]!r}")
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger


def _drain_socket(sock, timeout: float = 30.0) -> str:
    sock.settimeout(timeout)
    data = b""
    while not (b"data: [DONE]" in data and data.endswith(b"0\r\n\r\n")):
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


async def preemption_storm(server: ServerProcess, key: str, scale: int = 1) -> Ledger:
    """More long outputs at once than the KV pool holds: requests are preempted and recomputed,
    over and over; every one must still finish with all its tokens."""
    ledger = Ledger("KV exhaustion (preemption storm)")
    before = _preemptions(server)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as http:
        jobs = [send(http, "/v1/chat/completions", chat_body(f"Tell story number {i}", 200, ignore_eos=True),
                     bearer(key)) for i in range(16 * scale)]
        results = await asyncio.gather(*jobs)
    _record(ledger, list(results))
    _check_full(ledger, list(results), 200)
    preemptions = _preemptions(server) - before
    ledger.notes.append(f"{preemptions:.0f} preemptions")
    if preemptions <= 0:
        raise AssertionError("the pool never ran out: the scenario did not inject its fault")
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger


def _preemptions(server: ServerProcess) -> float:
    """Preemptions of either kind (recompute, swap) the server has counted."""
    m = server.metrics()
    return m.get("ferrylm:num_preemptions_total", 0.0) + m.get("ferrylm:num_swapped_out_total", 0.0)


async def overload(server: ServerProcess, key: str, scale: int = 1) -> Ledger:
    """4x more than the engine drains, from a batch-tier tenant (2 s wait budget): admission
    control answers 429 + Retry-After at once; every admitted request completes."""
    ledger = Ledger("4x overload")
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        jobs = []
        for i in range(60 * scale):
            jobs.append(asyncio.create_task(send(
                http, "/v1/chat/completions", chat_body(f"Item {i}", 48, stream=i % 2 == 0, ignore_eos=True),
                bearer(key))))
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*jobs)
    _record(ledger, list(results))
    _check_full(ledger, list(results), 48)
    if not ledger.counts["shed"]:
        ledger.notes.append("nothing was shed (the engine kept up)")
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger


async def engine_stall(server: ServerProcess, key: str, stall_s: float = 4.0) -> Ledger:
    """The engine loop wedged (test hook) with streams in flight: /health fails while it is
    silent; once it moves again the streams finish. Recovery: stall end → /health 200."""
    ledger = Ledger("engine loop stuck")
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        jobs = [asyncio.create_task(send(http, "/v1/chat/completions", chat_body(f"Fact {i}", 64, ignore_eos=True),
                                         bearer(key))) for i in range(6)]
        await asyncio.sleep(0.5)
        (await http.post(f"/debug/stall?seconds={stall_s}")).raise_for_status()
        stall_end = time.monotonic() + stall_s
        saw_unhealthy = False
        while time.monotonic() < stall_end + 10:
            code = (await http.get("/health")).status_code
            if code != 200:
                saw_unhealthy = True
            elif saw_unhealthy and time.monotonic() >= stall_end:
                ledger.recovery_s = time.monotonic() - stall_end
                break
            await asyncio.sleep(0.05)
        if not saw_unhealthy:
            raise AssertionError("/health never failed while the engine loop was stuck")
        results = await asyncio.gather(*jobs)
    _record(ledger, list(results))
    _check_full(ledger, list(results), 64)
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger


async def sigterm_under_load(server: ServerProcess, key: str, scale: int = 1) -> Ledger:
    """SIGTERM with streams in flight and requests still arriving: the in-flight ones finish,
    later ones are refused (503 + Retry-After or connection refused), the process exits 0."""
    ledger = Ledger("SIGTERM under load")
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        inflight = [asyncio.create_task(send(http, "/v1/chat/completions",
                                             chat_body(f"Recipe {i}", 64, ignore_eos=True), bearer(key)))
                    for i in range(8 * scale)]
        await _until_in_engine(server, inflight)  # a loaded machine may take seconds to admit them
        server.proc.send_signal(signal.SIGTERM)
        late = []
        for i in range(8 * scale):
            await asyncio.sleep(0.05)
            late.append(asyncio.create_task(send(http, "/v1/chat/completions", chat_body(f"Late {i}", 16),
                                                 bearer(key))))
        results = await asyncio.gather(*inflight, *late)
    _record(ledger, list(results))
    _check_full(ledger, list(results[:len(inflight)]), 64)
    code = await asyncio.to_thread(server.proc.wait, 60)
    if code != 0:
        ledger.record("lost", f"exit code {code}")
    return ledger


async def _until_in_engine(server: ServerProcess, tasks: list[asyncio.Task], timeout_s: float = 60.0) -> None:
    """Wait until every request of `tasks` is running or waiting in the engine or already answered
    (admission sheds some on a loaded machine: those never enter), or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = await asyncio.to_thread(server.metrics)
        answered = sum(t.done() for t in tasks)
        if m["ferrylm:num_requests_running"] + m["ferrylm:num_requests_waiting"] + answered >= len(tasks):
            return
        await asyncio.sleep(0.05)


# -- a fleet behind the gateway ----------------------------------------------------------------

async def _fleet_load(gateway: ServerProcess, n: int, spacing_s: float, max_tokens: int,
                      fault: Callable[[], Awaitable[None]], fault_after_s: float) -> list[Result]:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as http:
        jobs = []
        start = time.monotonic()
        fault_task = None
        for i in range(n):
            if fault_task is None and time.monotonic() - start >= fault_after_s:
                fault_task = asyncio.create_task(fault())
            jobs.append(asyncio.create_task(send(
                http, "/v1/chat/completions", chat_body(f"Question {i}", max_tokens, ignore_eos=True))))
            await asyncio.sleep(spacing_s)
        results = await asyncio.gather(*jobs)
        if fault_task is not None:
            await fault_task
    return list(results)


def router_gauge(gateway: ServerProcess, name: str, replica: ServerProcess) -> float:
    return gateway.metrics().get(f"ferrylm:router_{name}{{model_group={MODEL},replica={replica.base_url}}}", -1.0)


async def _wait_gauge(gateway: ServerProcess, name: str, replica: ServerProcess, value: float,
                      timeout: float) -> float | None:
    """Seconds until the gateway's gauge for `replica` reads `value` (None: never)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if await asyncio.to_thread(router_gauge, gateway, name, replica) == value:
            return time.monotonic() - start
        await asyncio.sleep(0.02)
    return None


async def replica_stuck(gateway: ServerProcess, victim: ServerProcess, survivor: ServerProcess,
                        scale: int = 1, stall_s: float = 5.0) -> Ledger:
    """One replica's engine loop wedged under load: its /ready fails, the gateway ejects it and
    sends new work to the other; the stuck streams finish once it moves. Recovery: the time from
    the stall until the gateway stops choosing it."""
    ledger = Ledger("replica engine stuck (gateway)")
    ejected: list[float | None] = []

    async def fault() -> None:
        async with httpx.AsyncClient() as http:
            (await http.post(victim.url(f"/debug/stall?seconds={stall_s}"))).raise_for_status()
        ejected.append(await _wait_gauge(gateway, "upstream_healthy", victim, 0, stall_s + 5))

    results = await _fleet_load(gateway, 30 * scale, 0.1, 32, fault, 0.5)
    _record(ledger, results)
    _check_full(ledger, results, 32)
    ledger.recovery_s = ejected[0] if ejected else None
    if ledger.recovery_s is None:
        raise AssertionError("the gateway never marked the stuck replica unhealthy")
    if await _wait_gauge(gateway, "upstream_healthy", victim, 1, 30) is None:
        raise AssertionError("the replica never came back once its loop moved again")
    ledger.leaked_blocks = await leaked_blocks(victim) + await leaked_blocks(survivor)
    return ledger


async def replica_killed(gateway: ServerProcess, victim: ServerProcess, survivor: ServerProcess,
                         scale: int = 1) -> Ledger:
    """SIGKILL of a replica mid-stream: its open streams end with an SSE error event, requests
    that had no token yet are retried on the other, later ones never reach the dead one.
    Recovery: the kill → the gateway marking it down."""
    ledger = Ledger("replica SIGKILL mid-stream (gateway)")
    detected: list[float | None] = []

    async def fault() -> None:
        victim.proc.send_signal(signal.SIGKILL)
        detected.append(await _wait_gauge(gateway, "upstream_up", victim, 0, 10))

    results = await _fleet_load(gateway, 30 * scale, 0.1, 48, fault, 1.5)
    victim.proc.wait()
    _record(ledger, results)
    _check_full(ledger, results, 48)
    ledger.recovery_s = detected[0] if detected else None
    if ledger.recovery_s is None:
        raise AssertionError("the gateway never marked the killed replica down")
    ledger.notes.append(f"recovery in {ledger.recovery_s / POLL_INTERVAL_S:.1f} poll intervals")
    ledger.leaked_blocks = await leaked_blocks(survivor)
    return ledger


async def redis_outage(gateway: ServerProcess, key: str, redis_port: int, redis_dir: Path, mode: str,
                       scale: int = 1) -> Ledger:
    """Redis (the shared rate-limit store) killed and restarted under rate-limited load. `open`:
    every request still runs; `closed`: requests during the outage get 503 + Retry-After. Never a
    500. Recovery: restart → the first request metered again."""
    ledger = Ledger(f"Redis killed and restarted (fail-{mode})")
    redis = start_redis(redis_port, redis_dir)
    results: list[Result] = []
    try:
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=300) as http:
            async def burst(n: int, tag: str) -> list[Result]:
                return list(await asyncio.gather(*[
                    send(http, "/v1/chat/completions", chat_body(f"{tag} {i}", 8, stream=i % 2 == 0), bearer(key))
                    for i in range(n)]))

            results += await burst(6 * scale, "before")
            stop_redis(redis)
            during = await burst(6 * scale, "during")
            results += during
            if mode == "open" and any(r.outcome != "completed" for r in during):
                ledger.notes.append("fail-open refused a request during the outage")
            if mode == "closed" and not any(r.outcome == "shed" for r in during):
                raise AssertionError("fail-closed admitted requests with Redis down")
            redis = start_redis(redis_port, redis_dir)
            restarted = time.monotonic()
            while True:
                r = await send(http, "/v1/chat/completions", chat_body("after", 4, stream=False), bearer(key))
                results.append(r)
                if r.outcome == "completed" or time.monotonic() - restarted > 20:
                    break
                await asyncio.sleep(0.1)
            ledger.recovery_s = time.monotonic() - restarted
            results += await burst(6 * scale, "after")
    finally:
        stop_redis(redis)
    _record(ledger, results)
    return ledger


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# -- start-up ----------------------------------------------------------------------------------

def corrupt_models(real_gguf: Path, workdir: Path) -> dict[str, Path]:
    """Broken copies of the default model: cut short, a corrupt header, not a GGUF at all."""
    data = real_gguf.read_bytes()
    variants = {"truncated": data[: len(data) // 3], "corrupt header": data[:8] + os.urandom(4096) + data[4104:],
                "not a GGUF": os.urandom(1 << 20)}
    paths = {}
    for name, payload in variants.items():
        path = workdir / f"{name.replace(' ', '-')}.gguf"
        path.write_bytes(payload)
        paths[name] = path
    return paths


def start_with_model(path: Path, timeout: float = 120.0) -> tuple[int | None, float, str]:
    """(exit code or None if it never exited, seconds, log tail) of `ferrylm serve --model path`."""
    server = ServerProcess("--model", str(path), "--log-level", "warning")
    start = time.monotonic()
    try:
        code = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.monotonic() - start
    server.stop(5)
    return code, elapsed, server.log_tail(5)
