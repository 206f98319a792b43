"""A hostile tenant beside a steady one on one real `ferrylm serve` (hostile_tenant.py): the victim's
requests all complete with their quiet-run greedy text, the attacker never gets a 5xx, no KV block
leaks, and each kind of attack was really answered (not skipped)."""

from __future__ import annotations

import httpx

from tests.faults import hostile_tenant
from tests.faults.scenarios import run_and_check


def test_a_hostile_tenant_cannot_fail_slow_or_change_a_steady_one(tmp_path, fault_report):
    server, keys = hostile_tenant.start(tmp_path)
    try:
        ledger = run_and_check(hostile_tenant.hostile_tenant(server, keys), fault_report)
        victim_requests = 3 * len(hostile_tenant.VICTIM_PROMPTS)
        assert ledger.counts["completed"] >= victim_requests
        # the KV routes refused the attacker's key (403) and a forged transfer key (401)
        answers = next(n for n in ledger.notes if n.startswith("attacker answers"))
        assert "403 permission_denied" in answers and "401 invalid_api_key" in answers, answers
        assert "completed" in answers, answers  # its tool-forcing and scoring requests were served
        assert "victim ITL p99" in ledger.notes[0]
        assert any("without the gaps the client stalled across" in n for n in ledger.notes)
        # the tests' eager server: bench/faults.py's round waits on this hook for serve's compiled default
        assert httpx.get(server.url("/debug/runner"), timeout=10).json() == {"decode_compiled": False}
    finally:
        assert server.stop() == 0, server.log_tail()
