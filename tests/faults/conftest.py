"""Fixtures of the fault suite: the real processes each scenario breaks."""

from __future__ import annotations

import pytest

from tests.faults.ledger import Ledger


@pytest.fixture(scope="session")
def fault_report():
    """Every ledger of the session, printed as one table at the end (pytest -s shows it)."""
    ledgers: list[Ledger] = []
    yield ledgers
    if ledgers:
        from tests.faults.table import markdown_table

        print("\n" + markdown_table([ledger.row() for ledger in ledgers]))
