"""Background processes (grammar compile workers, the decode-graph compile worker) start below the
serving threads from their first instruction: their interpreter start-up and imports run before they
could lower themselves, and a grammar worker is restarted after every stopped compile."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ferrylm.model.background_priority import NICENESS, background_python

pytestmark = pytest.mark.skipif(os.name != "posix" or shutil.which("nice") is None, reason="needs POSIX nice")


def test_the_command_line_runs_python_under_nice():
    assert background_python("pkg.mod") == [shutil.which("nice"), "-n", str(NICENESS), sys.executable, "-m", "pkg.mod"]


def test_the_child_is_niced_before_its_own_code_runs(tmp_path):
    (tmp_path / "probe_nice.py").write_text("import os\nprint(os.nice(0))\n")
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    out = subprocess.run(background_python("probe_nice"), env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == min(19, os.nice(0) + NICENESS)  # nice adds to ours; the kernel caps it at 19
