"""How many cores this process may use: its CPU affinity, within every CPU quota of its cgroups.

One answer for the whole package: the default layout (how many workers, how many envs the
learner steps), whether waiters may spin, how many threads a unit's EnvPool runs, and the
benchmark's worker counts all ask :func:`usable_cores`. A container limited by a quota
(``docker --cpus 2``, a Kubernetes CPU limit, a SLURM job's cgroup) sees every core of the
host in its affinity mask, so the quota must be read too: cgroup v2's ``cpu.max`` and
cgroup v1's ``cpu.cfs_quota_us``, of this process's cgroup and of every parent up to the
mount's root (a parent's quota binds its children). This module imports no other part of
clusterenv, so that a worker can use it before it imports anything.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cgroup_quota_cores", "usable_cores"]

_PROC_SELF = Path("/proc/self")


def usable_cores() -> int:
    """The whole cores this process may run on: its affinity mask, within its cgroups' CPU quotas (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity mask
        cores = os.cpu_count() or 1
    quota = cgroup_quota_cores()
    return max(1, cores if quota is None else min(cores, quota))


def cgroup_quota_cores(proc_self: Path = _PROC_SELF) -> int | None:
    """The tightest CPU quota of this process's cgroups and their parents, in whole cores; ``None``: no quota.

    Args:
        proc_self: the ``/proc/<pid>`` directory to read ``cgroup`` and ``mountinfo`` from.

    A quota of 1.5 cores counts as 1: a spinning process needs a whole core.
    """
    try:
        membership = (proc_self / "cgroup").read_text()
        mounts = (proc_self / "mountinfo").read_text()
    except OSError:  # not Linux, or /proc hidden
        return None
    quotas = [q for directory in _cpu_cgroup_directories(membership, mounts) for q in _quotas_up_to_root(*directory)]
    return min(quotas) if quotas else None


def _cpu_cgroup_directories(membership: str, mounts: str) -> list[tuple[Path, Path, bool]]:
    """Each ``(this process's cgroup directory, the mount's root, is v2)`` that can hold a CPU quota."""
    paths: dict[str, str] = {}  # "v2" or "v1" -> the cgroup's path in its hierarchy
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    found = []
    for line in mounts.splitlines():
        before, separator, after = line.partition(" - ")
        fields, described = before.split(), after.split()
        if not separator or len(fields) < 5 or len(described) < 3:
            continue
        root, mount_point = fields[3], fields[4]
        fs_type, options = described[0], described[2]
        v1_cpu = fs_type == "cgroup" and "cpu" in options.split(",")
        version = "v2" if fs_type == "cgroup2" else "v1" if v1_cpu else None
        if version is None or version not in paths:
            continue
        path = paths[version]
        # Inside a container the mount's root is the container's own cgroup: the path is relative to it.
        relative = path[len(root) :] if root != "/" and path.startswith(root) else path
        mount = Path(_unescape(mount_point))
        found.append((mount / relative.lstrip("/"), mount, version == "v2"))
    return found


def _quotas_up_to_root(directory: Path, mount: Path, v2: bool) -> list[int]:
    """The quota of ``directory`` and of each parent up to ``mount``, in whole cores, where one is set."""
    quotas = []
    while True:
        quota = _v2_quota(directory) if v2 else _v1_quota(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == mount or mount not in directory.parents:
            return quotas
        directory = directory.parent


def _v2_quota(directory: Path) -> int | None:
    """``cpu.max``: ``"<quota> <period>"`` in µs, or ``"max <period>"`` for none."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _whole_cores(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(directory: Path) -> int | None:
    """``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (a quota of ``-1``: none)."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else _whole_cores(quota, period)
    except (OSError, ValueError):
        return None


def _whole_cores(quota: int, period: int) -> int | None:
    return max(1, quota // period) if period > 0 else None


def _unescape(path: str) -> str:
    r"""``mountinfo`` escapes spaces, tabs, newlines and backslashes as octal (``\\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path
