"""Gateway over HTTP: what the gateway costs per request and what admission control buys under
overload, against real `ferrylm serve` processes in one run.

Four servers, all with --max-num-seqs 8: bare (--no-gateway), the default gateway (anonymous),
the gateway with API-key auth (--require-auth; tenants and keys made with `ferrylm tenants/keys`),
and the same with --no-admission-control.

Overload (run first): capacity (completed req/s) of a closed loop of streaming chat requests, then
Poisson arrivals at a multiple of it (4x), the same arrival times for each mode: admission control
on (one row per tenant tier, on the API-key server) vs off. Per request: status, TTFT (first
content token), completion. Goodput = completed requests with TTFT within the SLO, per second
from the first arrival to the last answer.

Overhead: short non-streaming completions (a few-token prompt, max_tokens=1) sent one at a time,
interleaved request by request in a shuffled order over bare, anonymous and API-key servers;
latency p50/p99 per server and the difference to bare (with a bootstrap interval for p50).

    .venv/bin/python bench/gateway_http.py            # ~6-7 minutes on 2 cores
    .venv/bin/python bench/gateway_http.py --quick    # ~4 minutes (server start-up dominates)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.server_process import ServerProcess  # noqa: E402

OUT = Path(__file__).with_name("out")
BIG = str(10**12)  # tenant limits that never bind
TIER_BUDGET_S = {"premium": 30.0, "standard": 10.0, "batch": 2.0}  # AdmissionConfig defaults


def ferrylm(*args: str, db: str) -> str:
    """Run a `ferrylm tenants/keys` command; its last stdout line (the key, for `keys create`)."""
    out = subprocess.run([sys.executable, "-m", "ferrylm.cli", *args, "--state-db", db], check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return out.strip().splitlines()[-1]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- overhead ------------------------------------------------------------------------------
def overhead(servers: dict[str, tuple[ServerProcess, dict]], model: str, n: int, warmup: int,
             seed: int) -> dict[str, list[float]]:
    """`n` timed requests per server, one at a time, servers in a fresh random order each round."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "stream": False}
    clients = {name: httpx.Client(base_url=s.base_url, headers=h, timeout=30) for name, (s, h) in servers.items()}
    samples: dict[str, list[float]] = {name: [] for name in servers}
    rng = random.Random(seed)
    order = list(servers)
    try:
        for i in range(warmup + n):
            rng.shuffle(order)
            for name in order:
                t0 = time.perf_counter()
                r = clients[name].post("/v1/completions", json=body)
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise SystemExit(f"{name}: HTTP {r.status_code}: {r.text[:300]}")
                if i >= warmup:
                    samples[name].append(dt)
    finally:
        for c in clients.values():
            c.close()
    return samples


# -- overload ----------------------------------------------------------------------------
@dataclass
class Result:
    status: str  # "200", "429", "503", other code, "timeout", "error"
    latency: float  # to the end (200), to the answer (non-200), to the timeout
    ttft: float | None = None
    completion_tokens: int = 0
    complete: bool = False  # 200 and all max_tokens streamed
    admitted: bool = False  # a 200 status line arrived (the engine took the request)
    finished_at: float = 0.0  # perf_counter when the answer ended
    detail: str = ""  # the error message of a non-200 answer


async def chat_stream(client: httpx.AsyncClient, model: str, headers: dict, i: int, max_tokens: int,
                      timeout: float) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell story number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    state: dict = {}

    async def go() -> Result:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return Result(str(r.status_code), time.perf_counter() - start, detail=detail)
            state["admitted"] = True
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    state["tokens"] = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                if "ttft" not in state and choices and (choices[0].get("delta") or {}).get("content"):
                    state["ttft"] = time.perf_counter() - start
        tokens = state.get("tokens", 0)
        return Result("200", time.perf_counter() - start, state.get("ttft"), tokens, tokens == max_tokens, True)

    try:
        result = await asyncio.wait_for(go(), timeout)
    except TimeoutError:
        result = Result("timeout", time.perf_counter() - start, state.get("ttft"), admitted=bool(state.get("admitted")))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result = Result("error", time.perf_counter() - start, state.get("ttft"), admitted=bool(state.get("admitted")),
                        detail=repr(e)[:300])
    result.finished_at = time.perf_counter()
    return result


def _client(base_url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=4096)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits)


async def closed_loop(server: ServerProcess, model: str, headers: dict, concurrency: int, ramp: float, seconds: float,
                      max_tokens: int, timeout: float) -> tuple[float, float, dict[str, int]]:
    """Completed requests/s and output tokens/s of `concurrency` clients in steady state: requests
    that finish within `seconds` after a `ramp` (the queue fills up during the ramp); and the
    count of every answer by status."""
    done: list[Result] = []
    counter = iter(range(10**9))
    async with _client(server.base_url) as client:
        start = time.perf_counter()
        lo, hi = start + ramp, start + ramp + seconds

        async def worker() -> None:
            while time.perf_counter() < hi:
                done.append(await chat_stream(client, model, headers, next(counter), max_tokens, timeout))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    ok = [r for r in done if r.complete and lo <= r.finished_at <= hi]
    codes: dict[str, int] = {}
    for r in done:
        codes[r.status] = codes.get(r.status, 0) + 1
    return len(ok) / seconds, sum(r.completion_tokens for r in ok) / seconds, codes


async def open_loop(server: ServerProcess, model: str, headers: dict, arrivals: list[float], max_tokens: int,
                    timeout: float) -> tuple[list[Result], float]:
    """Requests sent at `arrivals` (s from the start); the results and the span from the start
    to the last answer (completion, refusal or timeout)."""
    async with _client(server.base_url) as client:
        start, tasks = time.perf_counter(), []
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(chat_stream(client, model, headers, i, max_tokens, timeout)))
        results = await asyncio.gather(*tasks)
    return results, max(r.finished_at for r in results) - start


def summarize(mode: str, results: list[Result], window: float, span: float, slo: float) -> dict:
    """Counts by outcome; goodput and tokens/s per second of `span` (first arrival to last answer)."""
    codes: dict[str, int] = {}
    for r in results:
        codes[r.status] = codes.get(r.status, 0) + 1
    admitted = [r for r in results if r.admitted]
    shed = [r for r in results if r.status in ("429", "503")]
    completed = [r for r in results if r.complete]
    good = [r for r in completed if r.ttft is not None and r.ttft <= slo]
    ttfts = [r.ttft for r in completed if r.ttft is not None]
    return {
        "mode": mode, "offered": len(results), "offered_per_s": len(results) / window, "codes": codes,
        "admitted": len(admitted), "shed": len(shed), "completed": len(completed),
        "timed_out": codes.get("timeout", 0),
        "span_s": span, "goodput_req_per_s": len(good) / span,
        "completed_tok_per_s": sum(r.completion_tokens for r in completed) / span,
        "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99), "ttft_max_s": max(ttfts, default=0.0),
        "shed_latency_p50_ms": pct([r.latency * 1e3 for r in shed], 50),
        "shed_latency_p99_ms": pct([r.latency * 1e3 for r in shed], 99),
        "shed_detail": shed[0].detail if shed else "",
    }


def settle(server: ServerProcess, timeout: float = 120.0) -> None:
    try:
        server.wait_idle(timeout)
    except TimeoutError as e:
        print(f"warning: {e}", file=sys.stderr)


# -- the two parts ---------------------------------------------------------------------------
def run_overload(args: argparse.Namespace, on: ServerProcess, off: ServerProcess, keys: dict[str, dict],
                 tiers: list[str]) -> dict:
    """Capacity from the admission-off server (nothing shed); the same closed loop first on the
    admission-on server as a warm-up that teaches it this workload's completion length and drain
    rate. Then the same Poisson arrivals against each mode."""
    caps = [asyncio.run(closed_loop(server, args.model, keys["standard"], args.capacity_concurrency,
                                    args.capacity_ramp, args.capacity_seconds, args.max_tokens, args.timeout))
            for server in (on, off)]
    cap_rps, cap_tps = caps[1][0], caps[1][1]
    rate = cap_rps * args.overload
    rng = random.Random(args.seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < args.overload_seconds:
        arrivals.append(t)
        t += rng.expovariate(rate)
    runs = [(f"on, {tier} tier ({TIER_BUDGET_S.get(tier, '?')} s budget)", on, keys[tier]) for tier in tiers]
    runs.append(("off (--no-admission-control)", off, keys["standard"]))
    rows, raw = [], {}
    for mode, server, headers in runs:
        settle(server)
        print(f"overload: {mode} ...", file=sys.stderr)
        results, span = asyncio.run(open_loop(server, args.model, headers, arrivals, args.max_tokens, args.timeout))
        rows.append(summarize(mode, results, args.overload_seconds, span, args.slo_ttft))
        raw[mode] = [asdict(r) for r in results]
    settle(off)

    print(f"\nOverload: --max-num-seqs {args.max_num_seqs}; capacity (closed loop, {args.capacity_concurrency} "
          f"streams, {args.max_tokens} tokens, admission off): {cap_rps:.2f} req/s, {cap_tps:.0f} out tok/s "
          f"{json.dumps(caps[1][2])}\n  (warm-up of the admission-on server: {caps[0][0]:.2f} req/s "
          f"{json.dumps(caps[0][2])})")
    print(f"Poisson arrivals at {args.overload:g}x = {rate:.2f} req/s for {args.overload_seconds:g} s "
          f"({len(arrivals)} requests), client timeout {args.timeout:g} s, goodput SLO TTFT <= {args.slo_ttft:g} s; "
          "goodput and tok/s per second of span (first arrival to last answer)")
    head = (f"{'admission':<34}{'offered':>8}{'admit':>6}{'shed':>5}{'done':>5}{'t/o':>5}{'goodput':>8}"
            f"{'tok/s':>7}{'TTFT p50/p99 s':>16}{'shed p50 ms':>12}{'span s':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ttft = f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f}"
        print(f"{r['mode']:<34}{r['offered']:>8}{r['admitted']:>6}{r['shed']:>5}{r['completed']:>5}"
              f"{r['timed_out']:>5}{r['goodput_req_per_s']:>8.2f}{r['completed_tok_per_s']:>7.0f}"
              f"{ttft:>16}{r['shed_latency_p50_ms']:>12.1f}{r['span_s']:>7.1f}")
    for r in rows:
        print(f"{r['mode']}: status counts {json.dumps(r['codes'])}"
              + (f"; first refusal: {r['shed_detail'][:200]}" if r["shed_detail"] else ""))
    sys.stdout.flush()
    return {"capacity": {"req_per_s": cap_rps, "out_tok_per_s": cap_tps, "codes": caps[1][2],
                         "warmup_on_server": {"req_per_s": caps[0][0], "codes": caps[0][2]}},
            "offered_req_per_s": rate, "overload": rows, "overload_raw": raw}


def bootstrap_p50_diff(xs: list[float], base: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """95% interval of p50(xs) - p50(base) by resampling both."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(xs), np.asarray(base)
    diffs = [np.median(rng.choice(a, a.size)) - np.median(rng.choice(b, b.size)) for _ in range(n)]
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def run_overhead(args: argparse.Namespace, servers: dict[str, tuple[ServerProcess, dict]]) -> dict:
    samples = overhead(servers, args.model, args.n, args.warmup, args.seed)
    bare = next(iter(samples.values()))
    rows = []
    for name, xs in samples.items():
        lo, hi = bootstrap_p50_diff(xs, bare, args.seed)
        rows.append({"server": name, "n": len(xs), "p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3,
                     "mean_ms": float(np.mean(xs)) * 1e3, "added_p50_ms": (pct(xs, 50) - pct(bare, 50)) * 1e3,
                     "added_p50_ci95_ms": [lo * 1e3, hi * 1e3], "added_p99_ms": (pct(xs, 99) - pct(bare, 99)) * 1e3})
    print(f"\nOverhead: per-request latency, /v1/completions max_tokens=1, stream off, {args.n} requests per server, "
          "interleaved in random order")
    print(f"{'server':<24}{'p50 ms':>8}{'p99 ms':>8}{'mean ms':>9}{'+p50 ms':>9}{'(95% CI)':>17}{'+p99 ms':>9}")
    for r in rows:
        ci = "({:+.2f}, {:+.2f})".format(*r["added_p50_ci95_ms"])
        print(f"{r['server']:<24}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}{r['mean_ms']:>9.2f}"
              f"{r['added_p50_ms']:>+9.2f}{ci:>17}{r['added_p99_ms']:>+9.2f}")
    sys.stdout.flush()
    return {"overhead": rows, "overhead_samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}


# -- main ------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="engine size of every server")
    parser.add_argument("-n", type=int, default=300, help="part 1: timed requests per server")
    parser.add_argument("--warmup", type=int, default=20, help="part 1: untimed requests per server first")
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-ramp", type=float, default=4.0, help="seconds before counting completions")
    parser.add_argument("--capacity-seconds", type=float, default=12.0, help="counting window, per server")
    parser.add_argument("--overload", type=float, default=4.0, help="arrival rate as a multiple of capacity")
    parser.add_argument("--overload-seconds", type=float, default=20.0, help="arrival window")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    parser.add_argument("--tiers", default="standard,batch", help="admission-on rows: tenant tiers")
    parser.add_argument("--slo-ttft", type=float, default=5.0, help="goodput: TTFT within this (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small counts and short windows")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-overload", action="store_true")
    parser.add_argument("--json", type=Path, default=OUT / "gateway_http.json")
    args = parser.parse_args()
    if args.quick:
        args.n, args.warmup, args.capacity_seconds, args.overload_seconds, args.timeout = 60, 5, 6.0, 8.0, 30.0
    tiers = [t for t in args.tiers.split(",") if t]

    tmp = Path(tempfile.mkdtemp(prefix="ferrylm-gwbench-"))
    db_auth = f"sqlite:///{tmp / 'auth.db'}"
    keys = {}
    for tier in sorted(set(tiers) | {"standard"}):
        ferrylm("tenants", "create", f"bench-{tier}", "--tier", tier, "--rpm", BIG, "--tpm", BIG, db=db_auth)
        keys[tier] = {"Authorization": f"Bearer {ferrylm('keys', 'create', '--tenant', f'bench-{tier}', db=db_auth)}"}
    shutil.copy(tmp / "auth.db", tmp / "auth-noadm.db")  # same tenants and keys, its own SQLite file
    common = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
    specs = {
        "bare (--no-gateway)": ["--no-gateway"],
        "gateway, anonymous": ["--state-db", f"sqlite:///{tmp / 'open.db'}"],
        "gateway, API key": ["--require-auth", "--state-db", db_auth],
        "gateway, API key, no admission": ["--require-auth", "--state-db", f"sqlite:///{tmp / 'auth-noadm.db'}",
                                           "--no-admission-control"],
    }
    if args.skip_overload:
        specs.pop("gateway, API key, no admission")
    if args.skip_overhead:
        specs = {k: v for k, v in specs.items() if "API key" in k}
    t_start = time.perf_counter()
    servers = {name: ServerProcess(*common, *flags) for name, flags in specs.items()}
    report: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    try:
        for s in servers.values():
            s.wait_ready(300)
        print(f"{len(servers)} servers ready in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
        # Overload first: the admission-on server learns the mean completion length from the traffic
        # it serves, and part 1's one-token requests would teach it the wrong one.
        if not args.skip_overload:
            report |= run_overload(args, servers["gateway, API key"], servers["gateway, API key, no admission"],
                                   keys, tiers)
        if not args.skip_overhead:
            part1 = {name: (servers[name], keys["standard"] if "API key" in name else {}) for name in list(specs)[:3]}
            report |= run_overhead(args, part1)
    finally:
        codes = {name: s.stop() for name, s in servers.items()}
        if any(codes.values()):
            print(f"server exit codes: {codes}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - t_start
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nwall {report['wall_s']:.0f} s; json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
