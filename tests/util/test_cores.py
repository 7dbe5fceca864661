"""The usable core count: the host's, a CPU set's and a cgroup quota's, the fewest of them."""
from __future__ import annotations

import os

import pytest

from modules.util.cores import cgroup_quota_cores, usable_cores


def write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("text, quota", [("150000 100000\n", 1.5), ("max 100000\n", None),
                                         ("200000 100000", 2.0), ("garbage", None),
                                         ("50000 0", None)])
def test_cgroup_v2_quota(tmp_path, text, quota):
    write(tmp_path, "cpu.max", text)
    assert cgroup_quota_cores(tmp_path) == quota


@pytest.mark.parametrize("quota_us, quota", [("300000", 3.0), ("-1", None), ("x", None)])
def test_cgroup_v1_quota(tmp_path, quota_us, quota):
    write(tmp_path, "cpu/cpu.cfs_quota_us", quota_us)
    write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert cgroup_quota_cores(tmp_path) == quota


def test_no_cgroup_files_is_no_quota(tmp_path):
    assert cgroup_quota_cores(tmp_path) is None


def test_the_fewest_of_host_set_and_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert usable_cores(tmp_path) == 8                 # pinned to 8 of the host's 64
    write(tmp_path, "cpu.max", "250000 100000")
    assert usable_cores(tmp_path) == 3                 # a quota of 2.5 cores runs 3 threads
    write(tmp_path, "cpu.max", "10000 100000")
    assert usable_cores(tmp_path) == 1                 # a tenth of a core: still one
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cores(tmp_path) == 1


def test_here_it_is_at_most_the_host_count():
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
