"""Faults behind `ferrylm gateway` in front of two real replicas: Redis (the shared rate-limit
store) killed and restarted under limited load in both failure modes, one replica's engine loop
stuck, one replica SIGKILLed mid-stream. Each asserts the guarantee: nothing lost, no KV leaked."""

from __future__ import annotations

import pytest

from tests.faults import scenarios


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Every process of the module, started at once: two replicas, their gateway, and two auth
    gateways in front of the second replica sharing limits through one Redis."""
    workdir = tmp_path_factory.mktemp("redis")
    gateway, replicas = scenarios.spawn_fleet()
    limited, key, port = scenarios.spawn_limited_gateways(replicas[1], workdir)
    everything = [gateway, *replicas, *limited.values()]
    try:
        scenarios.wait_all(replicas, [gateway, *limited.values()])
        yield gateway, replicas, (limited, key, port, workdir)
    finally:
        for p in everything:
            p.stop()


@pytest.fixture(scope="module")
def fleet(processes):
    gateway, replicas, _ = processes
    return gateway, replicas


@pytest.fixture(scope="module")
def limited_gateways(processes):
    return processes[2]


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_killed_and_restarted(limited_gateways, mode, fault_report):
    gateways, key, port, workdir = limited_gateways
    ledger = scenarios.run_and_check(scenarios.redis_outage(gateways[mode], key, port, workdir, mode), fault_report)
    if mode == "open":
        assert ledger.counts["completed"] == ledger.total, ledger.counts
    else:
        assert ledger.counts["shed"] >= 6 and ledger.counts["completed"] >= 12, ledger.counts
    assert ledger.recovery_s is not None and ledger.recovery_s < 5
    assert gateways[mode].metrics()["ferrylm:rate_limiter_failures_total"] >= 6  # the outage is visible


def test_stuck_replica_is_ejected_and_returns(fleet, fault_report):
    gateway, (victim, survivor) = fleet
    ledger = scenarios.run_and_check(scenarios.replica_stuck(gateway, victim, survivor), fault_report)
    assert ledger.counts["completed"] == ledger.total, ledger.counts


def test_killed_replica_mid_stream(fleet, fault_report):
    gateway, (victim, survivor) = fleet  # last: the victim stays dead
    ledger = scenarios.run_and_check(scenarios.replica_killed(gateway, victim, survivor), fault_report)
    assert ledger.counts["completed"] >= 20, ledger.counts
