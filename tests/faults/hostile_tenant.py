"""The hostile-tenant scenario: tenant "victim" runs a steady greedy workload on one real
`ferrylm serve` (auth on, KV transfer on) while tenant "attacker", with its own key, tries every way
M3.2 closed to harm it: KV export/import with its key or a forged transfer key, malformed imports,
client-forced tool calls, grammar compile bombs abandoned after 2 s, scoring fan-out (echo +
logprobs + max_tokens 0 with n > 1).

Reported on the ledger: every victim request must complete (a victim request that does not is
"lost"), with the same greedy text as in the quiet baseline of the same run; the attacker gets
explicit errors or answers, never a 5xx; no KV block leaks. The victim's inter-token latency p99
under attack against its baseline goes to the notes (measured, not asserted: `make faults` records
it in bench/RESULTS.md), as measured and without the gaps across which the measuring client itself
was not running (ClientStalls). The attacker is another client: its own process (AttackerProcess), so
its requests are not built and parsed between the victim's token arrivals."""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.e2e.server_process import ServerProcess, make_keys
from tests.faults.client import MODEL, Result, chat_body, send
from tests.faults.ledger import Ledger
from tests.faults.scenarios import HOOKS, bearer, leaked_blocks

REPO = Path(__file__).resolve().parents[2]
TRANSFER_KEY = "kv-transfer-secret-of-the-replicas"
ARGS = ("--model", MODEL, "--dtype", "float32", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
        "--kv-role", "both", "--kv-transfer-key", TRANSFER_KEY, "--grammar-compile-timeout", "5",
        "--log-level", "warning")
VICTIM_PROMPTS = ["Describe a harbour at dawn.", "Name three rivers of Europe.", "How do ferries dock?",
                  "Write a haiku about tides."]
VICTIM_TOKENS = 32
ABANDON_S = 2.0
BLOCK = 3  # victim rounds in a row, quiet or attacked (an attacker round takes ~2 s: a bomb is abandoned)
SETTLE_S = 5.0  # the attack's last requests end, a killed compile worker is replaced (forked on Linux: ms)
STALL_S = 0.05  # the measuring client's event loop ran this much late: its gaps then are its own
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def start(workdir: Path, extra_args: tuple[str, ...] = (), compiled: bool = False,
          compile_timeout_s: float = 900.0) -> tuple[ServerProcess, dict[str, str]]:
    """The scenario's server (ARGS plus `extra_args`, e.g. a scheduler setting) and the two tenants' keys.
    `compiled`: serve's default decode path (compiled graphs, waited for: they compile or load in the
    background after start-up) instead of the tests' --enforce-eager."""
    db = f"sqlite:///{workdir / 'hostile.db'}"
    keys = make_keys(db, {"victim": {}, "attacker": {}})
    server = ServerProcess(*ARGS, *extra_args, "--require-auth", "--state-db", db, env=HOOKS, eager=not compiled)
    server.wait_ready()
    deadline = time.monotonic() + compile_timeout_s
    while compiled and not httpx.get(server.url("/debug/runner"), timeout=10).json()["decode_compiled"]:
        if time.monotonic() > deadline or server.proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"no decode graphs in use after {compile_timeout_s:.0f} s:\n{server.log_tail()}")
        time.sleep(1.0)
    return server, keys


async def _victim_round(http: httpx.AsyncClient, key: str, gaps: list[tuple[float, float]]) -> list[Result]:
    """Every victim prompt at once, streamed greedily; each (previous token, token) arrival pair
    appended to `gaps`."""
    arrivals: list[list[float]] = [[] for _ in VICTIM_PROMPTS]
    results = await asyncio.gather(*(
        send(http, "/v1/chat/completions", chat_body(p, VICTIM_TOKENS, ignore_eos=True), bearer(key), arrivals=a)
        for p, a in zip(VICTIM_PROMPTS, arrivals)))
    for times in arrivals:
        gaps.extend(zip(times, times[1:]))
    return list(results)


class ClientStalls:
    """Spells when this process's event loop ran late by more than STALL_S: the measuring client (it
    shares the host's cores with the server, and this host's VM is at times paused whole) was not
    running, so an arrival gap across such a spell measures the client, not the server. A 10 ms
    ticker; `overlaps(a, b)` says whether (a, b) met a spell."""

    def __init__(self) -> None:
        self.spells: list[tuple[float, float]] = []
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.01)
            end = time.perf_counter()
            if end - start - 0.01 > STALL_S:
                self.spells.append((start + 0.01, end))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def overlaps(self, a: float, b: float) -> bool:
        return any(s < b and a < e for s, e in self.spells)


def _bomb(i: int) -> dict:
    """A JSON schema that takes xgrammar many seconds to compile (unique per i: no cache hit)."""
    pattern = {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"}
    schema = {"type": "object", "properties": {f"p{k}": pattern for k in range(120)}}
    return chat_body(f"Fill the form {i}.", 32, stream=False,
                     response_format={"type": "json_schema", "json_schema": {"name": f"bomb{i}", "schema": schema}})


async def _abandoned(short: httpx.AsyncClient, key: str, i: int) -> Result:
    r = await send(short, "/v1/chat/completions", _bomb(i), bearer(key))
    return Result("cancelled", "client gave up") if r.outcome == "lost" and "Timeout" in r.detail else r


ATTACKS = ("kv", "tools", "bomb", "scoring")


def _attacks(http: httpx.AsyncClient, short: httpx.AsyncClient, key: str, i: int,
             kinds: tuple[str, ...] = ATTACKS) -> list:
    """One round of the attacker's requests of `kinds` (coroutines, each classified into a Result)."""
    own = bearer(key)
    forged = bearer("forged-" + TRANSFER_KEY)
    scoring = {"model": MODEL, "prompt": "The tide comes in and goes out. " * 24, "max_tokens": 0, "echo": True,
               "logprobs": 1, "n": 8, "temperature": 0}
    by_kind: dict[str, Callable[[], list]] = {  # coroutines made only for the kinds asked (none left unawaited)
        "kv": lambda: [send(http, "/v1/kv/export", {"prompt_token_ids": list(range(1, 65))}, own),
               send(http, "/v1/kv/import", {"blocks": "not safetensors"}, own),
               send(http, "/v1/kv/import", {"blocks": "not safetensors"}, forged)],
        "tools": lambda: [send(http, "/v1/chat/completions",
                       chat_body(f"Ignore the tools and print {{\"name\": \"get_weather\"}} {i}", 24, stream=False,
                                 tools=[WEATHER_TOOL], tool_choice="required"), own),
                  send(http, "/v1/chat/completions",
                       chat_body(f"Call it twice {i}", 24, tools=[WEATHER_TOOL],
                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}), own)],
        "bomb": lambda: [_abandoned(short, key, i)],
        "scoring": lambda: [send(http, "/v1/completions", scoring, own)],
    }
    return [coro for kind in kinds for coro in by_kind[kind]()]


async def attack_until(base_url: str, key: str, stop: asyncio.Event, kinds: tuple[str, ...]) -> list[Result]:
    """Rounds of the attacker's requests of `kinds` until `stop` (hostile_attacker.py runs this in its
    own process)."""
    results: list[Result] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http, \
            httpx.AsyncClient(base_url=base_url, timeout=ABANDON_S) as short:
        i = 0
        while not stop.is_set():
            results.extend(await asyncio.gather(*_attacks(http, short, key, i, kinds)))
            i += 1
    return results


def attacker_priority() -> list[str]:
    """The command prefix the attacker's client runs under (nice +19)."""
    nice = shutil.which("nice")
    return [nice, "-n", "19"] if nice else []


class AttackerProcess:
    """The attacker's client in its own process and session (hostile_attacker.py) at nice +19, its
    session's scheduling group too: on a deployment a tenant's client runs on its own machine, here it
    shares this host's cores with the server, so its own CPU (building, sending, parsing) yields to the
    server's; the server's handling of its requests runs at the server's priority, which is what is
    measured. `start` returns once its first requests
    are being sent, `stop` ends the attack and returns every request's Result."""

    def __init__(self, base_url: str, key: str, kinds: tuple[str, ...]):
        self._argv = (base_url, key, *kinds)
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *attacker_priority(), sys.executable, "-m", "tests.faults.hostile_attacker", *self._argv, cwd=REPO,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            start_new_session=True)  # its own scheduling group, lowered (hostile_attacker.lowest_session_priority)
        assert self._proc.stdout is not None
        line = await self._proc.stdout.readline()
        if line.strip() != b"attacking":
            raise RuntimeError(f"the attacker process did not start: {line!r}")

    async def stop(self) -> list[Result]:
        assert self._proc is not None
        out, _ = await self._proc.communicate(b"stop\n")
        if self._proc.returncode != 0:
            raise RuntimeError(f"the attacker process failed ({self._proc.returncode})")
        return [Result(**json.loads(line)) for line in out.splitlines() if line.strip()]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else (values or [0.0])[0]


async def hostile_tenant(server: ServerProcess, keys: dict[str, str], scale: int = 1,
                         attacks: tuple[str, ...] = ATTACKS) -> Ledger:
    """A warm-up victim round, then blocks of BLOCK victim rounds (`scale` rounds of each kind in all),
    quiet and attacked blocks alternating (the attacker runs the `attacks` of ATTACKS, all by default:
    fewer for an ablation). The attacker runs through a whole attacked block, so its requests meet the
    victim's rounds at every phase; alternating blocks lets the host's drift over minutes fall on both
    ITL samples alike. Before each quiet block the attacker's requests have ended and the server
    settled."""
    ledger = Ledger("hostile tenant" if attacks == ATTACKS else f"hostile tenant ({'+'.join(attacks)})")
    quiet: list[tuple[float, float]] = []
    attacked_gaps: list[tuple[float, float]] = []
    attacker_results: list[Result] = []
    block = min(BLOCK, max(1, scale))
    stalls = ClientStalls()
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as http:
        baseline = [await _victim_round(http, keys["victim"], [])]  # warm-up: ITL not counted
        # the measuring client's own pauses kept out: its start-up heap out of the collector's reach (a
        # full collection of it took 0.1-1.2 s on this loaded host), and its late wake-ups recorded
        gc.collect()
        gc.freeze()
        stalls.start()
        attacked = []
        try:
            for i in range(max(1, scale // block)):
                if i:  # the last block's attack has ended: its requests, and a killed compile worker's restart
                    await leaked_blocks(server)
                    await asyncio.sleep(SETTLE_S)
                baseline += [await _victim_round(http, keys["victim"], quiet) for _ in range(block)]
                attacker = AttackerProcess(server.base_url, keys["attacker"], attacks)
                await attacker.start()
                await asyncio.sleep(0.5)  # the attack is under way before the victim's first request
                attacked += [await _victim_round(http, keys["victim"], attacked_gaps) for _ in range(block)]
                attacker_results += await attacker.stop()
        finally:
            stalls.stop()
            gc.unfreeze()
    expected = [r.text for r in baseline[0]]
    for results in baseline + attacked:
        for r, text in zip(results, expected):
            if r.outcome != "completed" or r.completion_tokens != VICTIM_TOKENS:
                ledger.record("lost", f"victim request {r.outcome}: {r.detail}")
            elif r.text != text:
                ledger.record("lost", f"victim's greedy output changed: {r.text[:60]!r} != {text[:60]!r}")
            else:
                ledger.record("completed")
    for r in attacker_results:
        ledger.record(r.outcome, f"attacker: {r.detail}", r.latency_ms)
    quiet_itl, attacked_itl = [b - a for a, b in quiet], [b - a for a, b in attacked_gaps]
    ratio = _p99(attacked_itl) / max(_p99(quiet_itl), 1e-9)
    ledger.notes.append(f"victim ITL p99 {_p99(quiet_itl) * 1000:.1f} ms quiet, {_p99(attacked_itl) * 1000:.1f} ms "
                        f"attacked ({ratio:.2f}x); median {_median(quiet_itl) * 1000:.1f} → "
                        f"{_median(attacked_itl) * 1000:.1f} ms; {len(attacker_results)} attacker requests")
    answers = Counter(r.detail if r.outcome == "error" else r.outcome for r in attacker_results)
    ledger.notes.append(f"attacker answers: {dict(sorted(answers.items()))}")
    clean_q = [b - a for a, b in quiet if not stalls.overlaps(a, b)]
    clean_a = [b - a for a, b in attacked_gaps if not stalls.overlaps(a, b)]
    dropped = f"{len(quiet_itl) - len(clean_q)} of {len(quiet_itl)} quiet, " \
              f"{len(attacked_itl) - len(clean_a)} of {len(attacked_itl)} attacked"
    longest = max((e - s for s, e in stalls.spells), default=0.0)
    ledger.notes.append(f"victim ITL p99 without the gaps the client stalled across (> {STALL_S * 1000:.0f} ms late; "
                        f"{dropped}): {_p99(clean_q) * 1000:.1f} → {_p99(clean_a) * 1000:.1f} ms "
                        f"({_p99(clean_a) / max(_p99(clean_q), 1e-9):.2f}x); {len(stalls.spells)} stalls, "
                        f"longest {longest * 1000:.0f} ms")
    ledger.leaked_blocks = await leaked_blocks(server)
    return ledger
