"""The CPU thread count: physical cores in the affinity mask, a cgroup quota, the env overrides."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.cpu.cpu_threads import cgroup_cpu_limit, configure_cpu_threads, physical_cores


def _topology(root, cpu: int, package: int, core: int) -> None:
    d = root / f"cpu{cpu}" / "topology"
    d.mkdir(parents=True)
    (d / "physical_package_id").write_text(f"{package}\n")
    (d / "core_id").write_text(f"{core}\n")


def test_smt_siblings_count_once(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)]):
        _topology(tmp_path, cpu, package, core)
    assert physical_cores({0, 1, 2, 3, 4, 5}, tmp_path) == 3
    assert physical_cores({0, 2}, tmp_path) == 1  # two hyperthreads of one core
    assert physical_cores({0, 9}, tmp_path) == 2  # unreadable topology: count CPUs


@pytest.mark.parametrize("text,want", [("max 100000\n", None), ("200000 100000\n", 2), ("150000 100000", 2),
                                       ("50000 100000", 1), ("garbage", None)])
def test_cgroup_quota(tmp_path, text, want):
    (tmp_path / "cpu.max").write_text(text)
    assert cgroup_cpu_limit(tmp_path / "cpu.max") == want
    assert cgroup_cpu_limit(tmp_path / "missing") is None


def test_env_overrides():
    before = torch.get_num_threads()
    try:
        assert configure_cpu_threads({"FERRYLM_CPU_THREADS": "1"}) == 1 == torch.get_num_threads()
        assert configure_cpu_threads({"OMP_NUM_THREADS": "7"}) == 1  # left to torch: unchanged
        assert configure_cpu_threads({}) == 1  # the default never raises an explicit lower count
        with pytest.raises(ValueError, match="FERRYLM_CPU_THREADS"):
            configure_cpu_threads({"FERRYLM_CPU_THREADS": "0"})
    finally:
        torch.set_num_threads(before)
