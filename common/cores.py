"""The cores a process may use: its CPU affinity capped by its cgroup's CPU quota (a Kubernetes pod's limit)."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path


def _cgroup_cpus(cgroup: Path) -> float | None:
    """CPUs the cgroup's CFS quota allows (quota / period), None without a quota.

    cgroup v2: ``<cgroup>/cpu.max`` ("max 100000" or "150000 100000");
    cgroup v1: ``<cgroup>/cpu/cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``.
    """
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    for sub in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((cgroup / sub / "cpu.cfs_quota_us").read_text())
            period = int((cgroup / sub / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cores(affinity: Collection[int] | None = None, cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity, capped by its cgroup's CPU quota (rounded down), >= 1.

    The default thread count of a shard's optimizer step (``--threads``).
    Read once at the edge (CLI, ``ShardConfig``).

    Args:
        affinity: the CPUs the process may run on; None: ``os.sched_getaffinity(0)``
            (``os.cpu_count()`` where the platform has no affinity).
        cgroup: the cgroup directory whose quota applies (a Kubernetes pod's CPU limit).
    """
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = max(1, len(affinity))
    quota = _cgroup_cpus(cgroup)
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores
