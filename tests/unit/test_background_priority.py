"""Background processes (grammar compile workers, the decode-graph compile worker) start below the
serving threads from their first instruction: their interpreter start-up and imports run before they
could lower themselves, and a grammar worker is restarted after every stopped compile. On Linux they
run under SCHED_IDLE (a waking serving thread or client preempts them at once), else at nice +19."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ferrylm.model.background_priority import NICENESS, background_python

pytestmark = pytest.mark.skipif(os.name != "posix" or shutil.which("nice") is None, reason="needs POSIX nice")
IDLE_POLICY = sys.platform.startswith("linux") and shutil.which("chrt") is not None and \
    subprocess.run(["chrt", "--idle", "0", "true"], capture_output=True).returncode == 0


def test_the_command_line_runs_python_under_nice_and_sched_idle_where_it_can():
    niced = [shutil.which("nice"), "-n", str(NICENESS), sys.executable, "-m", "pkg.mod", "7"]
    expected = [shutil.which("chrt"), "--idle", "0", *niced] if IDLE_POLICY else niced
    assert background_python("pkg.mod", "7") == expected


def test_the_child_is_lowered_before_its_own_code_runs(tmp_path):
    (tmp_path / "probe_priority.py").write_text("import os\nprint(os.nice(0), os.sched_getscheduler(0))\n")
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    out = subprocess.run(background_python("probe_priority"), env=env, capture_output=True, text=True, check=True)
    niceness, policy = map(int, out.stdout.split())
    assert niceness == min(19, os.nice(0) + NICENESS)  # nice adds to ours; the kernel caps it at 19
    if IDLE_POLICY:
        assert policy == os.SCHED_IDLE


def test_a_process_lowers_itself_to_sched_idle():
    probe = "from ferrylm.model.background_priority import yield_cpu_to_serving as y; import os; " \
            "print(y(), os.sched_getscheduler(0))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    niceness, policy = map(int, out.stdout.split())
    assert niceness == 19
    if sys.platform.startswith("linux"):
        assert policy == os.SCHED_IDLE
