"""The Python processes clusterenv starts on this host (workers, env processes): their environment and what they use."""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

from clusterenv.wire.transport import SECRET_ENV_VAR

__all__ = ["ResourceUsage", "child_environment", "descendants", "resource_usage"]

# The processes are the parallelism: a math library's own threads in each only oversubscribe the cores.
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def child_environment(secret: bytes | None) -> dict[str, str]:
    """This process's environment for a child, with the shared secret only for a child that talks to the learner.

    The child gets this process's import path and one thread per math library (unless set);
    an env process never talks to the learner, so it gets no secret (``secret=None``).
    """
    env = {name: value for name, value in os.environ.items() if name != SECRET_ENV_VAR}
    if secret is not None:
        env[SECRET_ENV_VAR] = secret.decode()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for var in _THREAD_VARS:
        env.setdefault(var, "1")
    return env


class ResourceUsage(NamedTuple):
    """What a process and its descendants have used: CPU seconds (user + system) so far, and resident memory now."""

    cpu_s: float
    rss_mb: float


def resource_usage(pid: int) -> ResourceUsage | None:
    """The usage of process ``pid`` with its descendants (a worker with its env processes), from ``/proc``.

    ``None`` where there is no ``/proc`` (not Linux) or the process is gone. A descendant that
    exits while it is read is left out.
    """
    ticks = 0
    pages = 0
    for i, process in enumerate([pid, *descendants(pid)]):
        try:
            with open(f"/proc/{process}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # the name before ")" may hold spaces
            with open(f"/proc/{process}/statm") as f:
                resident = int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            if i == 0:
                return None
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
        pages += resident
    return ResourceUsage(ticks / os.sysconf("SC_CLK_TCK"), pages * os.sysconf("SC_PAGE_SIZE") / 2**20)


def descendants(pid: int) -> list[int]:
    """The pids of process ``pid``'s children, theirs, and so on (``/proc``; empty where there is none)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(child) for child in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found
