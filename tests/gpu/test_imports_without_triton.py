"""The GPU modules import on machines without triton or CUDA (CI, the CPU path)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["triton"] = None  # as if it were not installed
import torch
import ferrylm.model.attention.triton as t
import ferrylm.model.compile.cuda_graphs
from ferrylm.model.attention import AttentionSpec, select_backend
assert not t.triton_available()
spec = AttentionSpec(4, 2, 16, 16, torch.float32, torch.device("cuda"))
for make in (lambda: t.TritonBackend(spec), lambda: select_backend(spec, "triton")):
    try:
        make()
    except RuntimeError as e:
        assert "triton" in str(e)
    else:
        raise SystemExit("TritonBackend() should raise without triton")
assert type(select_backend(spec)).__name__ == "TorchNativeBackend"  # auto on CUDA without triton
print("ok")
"""


def test_modules_import_and_backend_refuses_without_triton():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
