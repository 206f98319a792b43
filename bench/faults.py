"""The long fault-injection campaign (`make faults`): every scenario of tests/faults, at scale,
round after round with fresh processes, until at least --min-requests requests were sent. Prints
one row per scenario (requests, accepted, completed, explicit errors, shed, lost, leaked KV
blocks, shed p99, worst recovery) and with --write appends the table to bench/RESULTS.md.

Loopback only; real `ferrylm serve` / `ferrylm gateway` processes and the real model. The CPU
check reads /proc/stat: the share of busy CPU time used by processes other than this campaign
and its servers (the servers are children; ~0 means a quiet machine).

    .venv/bin/python bench/faults.py [--min-requests 10000] [--scale 25] [--only hostile ...] [--write]

The hostile-tenant round serves with serve's default decode path (compiled graphs, waited for after
start-up; --hostile-eager: the tests' --enforce-eager instead), since its victim ITL ratio is a goal
for what users run; the other rounds run eagerly, as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cpu_check import ForeignCpu  # noqa: E402
from tests.faults import hostile_tenant, scenarios  # noqa: E402
from tests.faults.ledger import Ledger  # noqa: E402
from tests.faults.table import markdown_table  # noqa: E402
from tests.faults.test_startup import default_gguf  # noqa: E402


class Campaign:
    """Ledgers merged by scenario across rounds."""

    def __init__(self) -> None:
        self.ledgers: dict[str, Ledger] = {}

    def add(self, ledger: Ledger) -> None:
        print(f"  {ledger.scenario}: {ledger.row()} {ledger.notes}", flush=True)
        old = self.ledgers.get(ledger.scenario)
        self.ledgers[ledger.scenario] = old.merged(ledger) if old else ledger

    @property
    def total(self) -> int:
        return sum(ledger.total for ledger in self.ledgers.values())


def single_replica_round(campaign: Campaign, scale: int, seed: int, workdir: Path) -> None:
    server, keys = scenarios.start_replica(workdir)
    try:
        campaign.add(asyncio.run(scenarios.disconnect_storm(server, keys["steady"], scale, seed)))
        campaign.add(asyncio.run(scenarios.overload(server, keys["bulk"], scale)))
        campaign.add(asyncio.run(scenarios.preemption_storm(server, keys["steady"], max(1, scale // 8))))
        campaign.add(asyncio.run(scenarios.slow_reader(server, keys["steady"], max(1, scale // 4))))
        campaign.add(asyncio.run(scenarios.engine_stall(server, keys["steady"])))
        campaign.add(asyncio.run(scenarios.sigterm_under_load(server, keys["steady"], max(1, scale // 4))))
    finally:
        server.stop()


def fleet_round(campaign: Campaign, scale: int, workdir: Path) -> None:
    gateway, replicas = scenarios.spawn_fleet()
    limited, key, port = scenarios.spawn_limited_gateways(replicas[1], workdir)
    try:
        scenarios.wait_all(replicas, [gateway, *limited.values()])
        for mode in ("open", "closed"):
            campaign.add(asyncio.run(scenarios.redis_outage(limited[mode], key, port, workdir, mode,
                                                            max(1, scale // 2))))
        campaign.add(asyncio.run(scenarios.replica_stuck(gateway, replicas[0], replicas[1], max(1, scale // 4))))
        campaign.add(asyncio.run(scenarios.replica_killed(gateway, replicas[0], replicas[1], max(1, scale // 4))))
    finally:
        for p in (*limited.values(), gateway, *replicas):
            p.stop()


def hostile_tenant_round(campaign: Campaign, scale: int, workdir: Path, attacks: list[str] | None = None,
                         server_args: tuple[str, ...] = (), eager: bool = False) -> None:
    """The hostile-tenant scenario; `attacks` (--attacks): also one run per listed attack alone;
    `server_args` (--hostile-server-args): added to the scenario's server command line; `eager`
    (--hostile-eager): the eager decode step instead of serve's compiled default."""
    server, keys = hostile_tenant.start(workdir, server_args, compiled=not eager)
    try:
        campaign.add(asyncio.run(hostile_tenant.hostile_tenant(server, keys, max(1, scale // 4))))
        for attack in attacks or ():
            campaign.add(asyncio.run(hostile_tenant.hostile_tenant(server, keys, max(1, scale // 4), (attack,))))
    finally:
        server.stop()


def startup_round(campaign: Campaign, workdir: Path) -> None:
    for variant, path in scenarios.corrupt_models(default_gguf(), workdir).items():
        code, seconds, log = scenarios.start_with_model(path)
        ledger = Ledger(f"model file {variant}")
        ok = code not in (None, 0) and "could not load the model" in log
        ledger.record("error" if ok else "lost", log)
        ledger.recovery_s = seconds
        campaign.add(ledger)


def cpu_line() -> str:
    """The CPU model and the vector extensions the kernels care about (lscpu)."""
    text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("Flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "asimd")
    return f"{model}, {os.cpu_count()} CPUs, flags {' '.join(f for f in wanted if f in flags)}"


ROUNDS = {
    "single": lambda c, scale, seed, workdir: single_replica_round(c, scale, seed, workdir),
    "fleet": lambda c, scale, seed, workdir: fleet_round(c, scale, workdir),
    "hostile": lambda c, scale, seed, workdir: hostile_tenant_round(c, scale, workdir),
    "startup": lambda c, scale, seed, workdir: startup_round(c, workdir),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-requests", type=int, default=10_000)
    ap.add_argument("--scale", type=int, default=25, help="request-count multiplier of each scenario")
    ap.add_argument("--max-rounds", type=int, default=20)
    ap.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    ap.add_argument("--only", choices=sorted(ROUNDS), action="append",
                    help="run only these kinds of round (repeatable; default: all)")
    ap.add_argument("--attacks", nargs="+", choices=hostile_tenant.ATTACKS,
                    help="hostile round: also measure each of these attacks alone (the ablation)")
    ap.add_argument("--hostile-server-args", default="",
                    help="hostile round: extra `ferrylm serve` flags, e.g. '--long-prefill-token-threshold 32'")
    ap.add_argument("--hostile-eager", action="store_true",
                    help="hostile round: the eager decode step (the tests' setting) instead of serve's compiled one")
    args = ap.parse_args()
    kinds = args.only or list(ROUNDS)

    campaign, rounds, start = Campaign(), 0, time.monotonic()
    with ForeignCpu(children=True) as cpu, tempfile.TemporaryDirectory(prefix="ferrylm-faults-") as tmp:
        while campaign.total < args.min_requests and rounds < args.max_rounds:
            print(f"round {rounds + 1}: {campaign.total} requests so far", flush=True)
            workdir = Path(tmp) / f"round{rounds}"
            workdir.mkdir()
            for kind in kinds:
                if kind == "hostile":
                    hostile_tenant_round(campaign, args.scale, workdir, args.attacks,
                                         tuple(args.hostile_server_args.split()), args.hostile_eager)
                elif kind != "startup" or rounds == 0:
                    ROUNDS[kind](campaign, args.scale, rounds, workdir)
            rounds += 1
    minutes = (time.monotonic() - start) / 60
    rows = [ledger.row() for ledger in campaign.ledgers.values()]
    lost = sum(ledger.counts["lost"] for ledger in campaign.ledgers.values())
    leaked = sum(ledger.leaked_blocks or 0 for ledger in campaign.ledgers.values())
    table = markdown_table(rows)
    summary = (f"{campaign.total} requests in {rounds} rounds ({minutes:.1f} min): lost {lost}, "
               f"KV blocks leaked {leaked}; other processes' CPU share {cpu.share:.3f}")
    for name, ledger in campaign.ledgers.items():  # the victim's ITL p99 quiet vs attacked, per round
        if name.startswith("hostile tenant"):
            summary += f"\n\n{name}, per round: " + "; ".join(n for n in ledger.notes if "ITL" in n)
    print(table + "\n\n" + summary)
    for ledger in campaign.ledgers.values():
        if ledger.lost_details:
            print(f"{ledger.scenario} lost: {ledger.lost_details[:5]}")
    if args.write:
        with (ROOT / "bench" / "RESULTS.md").open("a") as f:
            only = "".join(f" --only {k}" for k in args.only or [])
            f.write(f"\n## Fault-injection campaign (`make faults`, {time.strftime('%Y-%m-%d')})\n\n"
                    f"`.venv/bin/python bench/faults.py --min-requests {args.min_requests} --scale {args.scale}"
                    f"{only} --write`; CPU: {cpu_line()}\n\n{table}\n\n{summary}\n")
    sys.exit(1 if lost or leaked else 0)


if __name__ == "__main__":
    main()
