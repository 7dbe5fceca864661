"""How many CPU cores this process may really use.

`os.cpu_count()` counts the host's cores. In a container (a rented cloud GPU, a CI runner) the
process is often allowed fewer: a CPU set (`taskset`, docker `--cpuset-cpus`) or a cgroup quota
(docker `--cpus`, a Kubernetes limit). Thread counts sized from the host's count oversubscribe
the cores the process has, and a warning that compares threads with cores says the wrong thing.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_quota_cores(root: Path = CGROUP) -> float | None:
    """The cores a cgroup CPU quota allows (e.g. 2.5), or None without a quota: cgroup v2's
    `cpu.max` ("max 100000" means none), else cgroup v1's cfs quota and period (-1: none).
    Unreadable or malformed files count as no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores(root: Path = CGROUP) -> int:
    """The cores this process may run on: the fewest of the host's count, the CPU set it is
    pinned to and its cgroup quota (rounded up: a quota of 1.5 cores runs two threads at
    three quarters each). At least 1."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):  # not on macOS or Windows
        counts.append(len(os.sched_getaffinity(0)))
    quota = cgroup_quota_cores(root)
    if quota is not None:
        counts.append(math.ceil(quota))
    return max(1, min(counts))
