"""Faults behind `ferrylm gateway` in front of two real replicas: Redis (the shared rate-limit
store) killed and restarted under limited load in both failure modes, one replica's engine loop
stuck, one replica SIGKILLed mid-stream. Each asserts the guarantee: nothing lost, no KV leaked."""

from __future__ import annotations

import asyncio

import pytest

from tests.faults import scenarios


@pytest.fixture(scope="module")
def fleet():
    gateway, replicas = scenarios.start_fleet()
    yield gateway, replicas
    for p in (gateway, *replicas):
        p.stop()


@pytest.fixture(scope="module")
def limited_gateways(fleet, tmp_path_factory):
    """Two auth gateways sharing limits through one Redis, fail-open and fail-closed."""
    _, replicas = fleet
    workdir = tmp_path_factory.mktemp("redis")
    gateways, key, port = scenarios.start_limited_gateways(replicas[1], workdir)
    yield gateways, key, port, workdir
    for gw in gateways.values():
        gw.stop()


def run(coro, report):
    ledger = asyncio.run(coro)
    report.append(ledger)
    print(ledger.row(), ledger.notes)
    ledger.assert_guarantee()
    return ledger


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_killed_and_restarted(limited_gateways, mode, fault_report):
    gateways, key, port, workdir = limited_gateways
    ledger = run(scenarios.redis_outage(gateways[mode], key, port, workdir, mode), fault_report)
    if mode == "open":
        assert ledger.counts["completed"] == ledger.total, ledger.counts
    else:
        assert ledger.counts["shed"] >= 6 and ledger.counts["completed"] >= 12, ledger.counts
    assert ledger.recovery_s is not None and ledger.recovery_s < 5


def test_stuck_replica_is_ejected_and_returns(fleet, fault_report):
    gateway, (victim, survivor) = fleet
    ledger = run(scenarios.replica_stuck(gateway, victim, survivor), fault_report)
    assert ledger.counts["completed"] == ledger.total, ledger.counts


def test_killed_replica_mid_stream(fleet, fault_report):
    gateway, (victim, survivor) = fleet  # last: the victim stays dead
    ledger = run(scenarios.replica_killed(gateway, victim, survivor), fault_report)
    assert ledger.counts["completed"] >= 20, ledger.counts
