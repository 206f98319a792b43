"""Triton kernels vs the torch-native oracle on CPU, through the Triton interpreter.

The cases run in one child process with TRITON_INTERPRET=1 (it must be set before triton is
imported, and must not leak into the other tests); each case is reported as its own test here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.interpreter_cases import CASE_NAMES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("interpreter_cases.py"))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", CASE_NAMES)
def test_kernel_matches_oracle_under_interpreter(interpreter_results: dict[str, str], case: str) -> None:
    outcome = interpreter_results[case]
    if outcome.startswith("skip: "):
        pytest.skip(outcome.removeprefix("skip: "))
    assert outcome == "ok", outcome
