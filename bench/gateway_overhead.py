"""Gateway overhead: latency the policy layer adds per request (admit + finish), p50/p99.

Scenarios: an API key with tenant limits over a SQLite file and in-memory buckets (sync core and
the async seam with its worker-thread hops), a HS256 JWT, an open server (anonymous), a request
shed by admission control (with and without its audit row), and the bare admission decision.
`--redis-url` adds the API-key scenario with Redis buckets.

    .venv/bin/python bench/gateway_overhead.py            # ~10 s on 2 cores
    .venv/bin/python bench/gateway_overhead.py -n 5000 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jwt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrylm.gateway import Gateway, GatewayConfig, JWTConfig  # noqa: E402
from ferrylm.gateway.admission import AdmissionController  # noqa: E402
from ferrylm.gateway.config import AdmissionConfig  # noqa: E402
from ferrylm.gateway.store import Store  # noqa: E402
from ferrylm.http.errors import APIError  # noqa: E402
from ferrylm.load_report import LoadReport  # noqa: E402

SECRET = "bench-secret-0123456789abcdef0123456789"
SATURATED = dataclasses.replace(LoadReport.empty(), num_waiting=500, num_running=64,
                                num_waiting_prompt_tokens=200_000, kv_blocks_used=99, kv_blocks_total=100)
BIG = 10**12  # limits that never bind, so every request takes the full path


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    p = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return p(0.50) * 1e3, p(0.99) * 1e3, statistics.fmean(ordered) * 1e3


def timed(fn: Callable[[], None], n: int, warmup: int = 50) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gateway(db: str, **config) -> Gateway:
    return Gateway(GatewayConfig(state_db=db, **config))


def admit_finish(gw: Gateway, headers: dict, stats=None) -> Callable[[], None]:
    def run() -> None:
        a = gw.admit_sync(headers, "127.0.0.1", "m", 100, 200, stats)
        gw.finish_sync(a, 200, 100, 150)
    return run


def admit_finish_async(gw: Gateway, headers: dict, n: int) -> list[float]:
    async def go() -> list[float]:
        out = []
        for i in range(n + 50):
            t0 = time.perf_counter()
            a = await gw.admit(headers, "127.0.0.1", "m", 100, 200, None)
            await gw.finish(a, 200, 100, 150)
            if i >= 50:
                out.append(time.perf_counter() - t0)
        return out
    return asyncio.run(go())


def shed(gw: Gateway, headers: dict) -> Callable[[], None]:
    def run() -> None:
        try:
            gw.admit_sync(headers, "127.0.0.1", "m", 100, 200, SATURATED)
        except APIError:
            return
        raise RuntimeError("expected a shed")
    return run


def scenarios(db: str, args: argparse.Namespace) -> dict[str, list[float]]:
    store = Store(db)
    store.create_tenant("acme", rpm=BIG, tpm=BIG, max_concurrency=1000, daily_tokens=BIG)
    key = {"authorization": f"Bearer {store.create_key('acme')[1]}"}
    token = jwt.encode({"tenant": "acme", "sub": "bench", "exp": time.time() + 3600}, SECRET, algorithm="HS256")
    n, results = args.n, {}
    gw = gateway(db, require_auth=True)
    results["api key, sqlite + memory limits (sync)"] = timed(admit_finish(gw, key), n)
    results["api key, sqlite + memory limits (async seam)"] = admit_finish_async(gw, key, n)
    gw_jwt = gateway(db, require_auth=True, jwt=JWTConfig(secret=SECRET))
    jwt_header = {"authorization": f"Bearer {token}"}
    results["jwt hs256, sqlite + memory limits (sync)"] = timed(admit_finish(gw_jwt, jwt_header), n)
    results["anonymous (open server) (sync)"] = timed(admit_finish(gateway(db), {}), n)
    gw_shed = gateway(db, require_auth=True)
    gw_shed.drain.observe_snapshot(SATURATED, 0.0)
    gw_shed.drain.observe_snapshot(dataclasses.replace(SATURATED, prompt_tokens_total=1000), 1.0)  # 1,000 tokens/s
    results["shed by admission (auth + audit row)"] = timed(shed(gw_shed, key), n)
    gw_quiet = gateway(db, require_auth=True, audit_rejections=False)
    gw_quiet.drain.observe_snapshot(SATURATED, 0.0)
    gw_quiet.drain.observe_snapshot(dataclasses.replace(SATURATED, prompt_tokens_total=1000), 1.0)
    results["shed by admission (auth, no audit row)"] = timed(shed(gw_quiet, key), n)
    controller = AdmissionController(AdmissionConfig())
    results["admission decision alone"] = timed(lambda: controller.decide(SATURATED, "standard", 1000.0, 128), n)
    if args.redis_url:
        gw_redis = gateway(db, require_auth=True, redis_url=args.redis_url, redis_key_prefix="bench:")
        results["api key, sqlite + redis limits (sync)"] = timed(admit_finish(gw_redis, key), n)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2000, help="requests per scenario")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = scenarios(f"sqlite:///{Path(tmp) / 'bench-state.db'}", args)
    width = max(len(name) for name in results)
    print(f"{'scenario':<{width}}  {'p50 ms':>8}  {'p99 ms':>8}  {'mean ms':>8}")
    for name, samples in results.items():
        p50, p99, mean = percentiles(samples)
        print(f"{name:<{width}}  {p50:8.3f}  {p99:8.3f}  {mean:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
