"""What a dead process leaves behind: the processes it started, and its scratch directories.

No code of a process killed with ``SIGKILL`` runs, so others clean up what it owned:

* A worker's env processes (simulators, an env's own ``AsyncVectorEnv``) are its
  descendants. Whoever ends a worker ends them too (:func:`kill_tree`): the worker's
  own watchdog thread when its learner is gone, or the learner's launcher when a worker
  ignores ``CLOSE``. Found from ``/proc``, so on Linux only; elsewhere only the worker ends.
* A learner's scratch directories (its ipc sockets, its shared observations file) carry
  its pid in their name (:func:`scratch_dir`). A worker that finds its learner gone removes
  those whose owner is gone (:func:`remove_stale_dirs`) before it exits, and so does every
  new learner (for a learner whose workers ran elsewhere). A live learner removes its own on
  close, or from a finalizer at interpreter exit.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import tempfile

__all__ = ["descendants", "kill_descendants", "kill_tree", "remove_stale_dirs", "scratch_dir", "shared_memory_base"]

logger = logging.getLogger(__name__)

# clusterenv-[KIND-]PID-SCOPE-XXXXXXXX: SCOPE tells whether this process can judge PID (see _scope).
_SCRATCH_NAME = re.compile(r"clusterenv-(?:[a-z]+-)?(?P<pid>[0-9]+)-(?P<scope>[0-9a-f]{8})-")


@functools.lru_cache(maxsize=1)
def _scope() -> str:
    """A tag of this host and pid namespace: only a process with the same tag can tell whether a pid is alive.

    A temp directory may be shared by containers (each with its own pids) or, through
    ``$TMPDIR`` on a network file system, by hosts.
    """
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def shared_memory_base() -> str | None:
    """Where memory-backed scratch files go: ``/dev/shm`` where it exists, else the temp directory (``None``)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def scratch_dir(kind: str = "", base: str | None = None) -> str:
    """A fresh ``0700`` directory ``clusterenv-[KIND-]PID-SCOPE-XXXXXXXX`` in ``base`` (default: the temp directory)."""
    prefix = f"clusterenv-{kind}-" if kind else "clusterenv-"
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{_scope()}-", dir=base)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # the name before ")" may hold spaces
    except (OSError, IndexError):
        return True  # no /proc: as far as we can tell


def remove_stale_dirs() -> list[str]:
    """Remove the scratch directories of learners on this host that died without cleaning up; returns their paths.

    Only directories of this user, named by :func:`scratch_dir` in this host and pid
    namespace, whose owner pid no longer exists. A recycled pid keeps its directory until
    that process ends too: stale directories are removed late, live ones never.
    """
    removed = []
    uid, scope = os.getuid(), _scope()
    for base in dict.fromkeys([tempfile.gettempdir(), shared_memory_base() or tempfile.gettempdir()]):
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            match = _SCRATCH_NAME.match(entry.name)
            if match is None or match["scope"] != scope or int(match["pid"]) == os.getpid():
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not entry.is_dir(follow_symlinks=False) or stat.st_uid != uid or _alive(int(match["pid"])):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    if removed:
        logger.info("Removed %d scratch directories of learners that are gone: %s", len(removed), removed)
    return removed


def descendants(*pids: int) -> list[int]:
    """The processes below ``pids``, parents before their children, from ``/proc`` (empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])  # the name before ")" may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, frontier = [], list(pids)
    while frontier:
        for child in children.get(frontier.pop(0), []):
            found.append(child)
            frontier.append(child)
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone already


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``."""
    _kill(descendants(pid))


def kill_tree(*pids: int) -> None:
    """SIGKILL ``pids`` and their descendants (these first: once a parent is gone they are re-parented, untraceable)."""
    if pids:
        _kill(descendants(*pids))
        _kill(list(pids))
