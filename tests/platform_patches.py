"""Linux-only calls taken away, as on another platform (macOS) or in a sandbox that refuses them.

Each patch takes a ``monkeypatch``-like object, so that it applies to the learner (pytest's
``monkeypatch``: undone after the test) and to the worker processes it starts, through a
``sitecustomize`` module on the path they inherit (:func:`sitecustomize`): applied when their
interpreter starts, before clusterenv loads, for their whole life. Nothing in clusterenv knows.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Patcher(Protocol):
    """What a patch uses of pytest's ``monkeypatch``."""

    def setattr(self, target: Any, name: str, value: Any) -> None: ...

    def delattr(self, target: Any, name: str) -> None: ...


class ForGood:
    """``monkeypatch``'s ``setattr`` and ``delattr``, never undone: for a process that ends with its test."""

    def setattr(self, target: Any, name: str, value: Any) -> None:
        setattr(target, name, value)

    def delattr(self, target: Any, name: str) -> None:
        delattr(target, name)


def _refused(*args: Any, **kwargs: Any) -> Any:
    raise PermissionError(errno.EPERM, "Operation not permitted")


def _no_room(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _hidden(prefix: str, function: Callable[..., Any], absent: Any = None) -> Callable[..., Any]:
    """``function``, where paths under ``prefix`` do not exist: ``FileNotFoundError`` (or ``absent``, returned)."""

    def without(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).startswith(prefix):
            if absent is not None:
                return absent
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", os.fsdecode(path))
        return function(path, *args, **kwargs)

    return without


def no_memfd(patch: Patcher) -> None:
    """No ``os.memfd_create`` (macOS, BSDs)."""
    patch.delattr(os, "memfd_create")


def memfd_refused(patch: Patcher) -> None:
    """A seccomp sandbox that refuses ``memfd_create`` with ``EPERM``."""
    patch.setattr(os, "memfd_create", _refused)


def no_seals(patch: Patcher) -> None:
    """A memfd, but no file seals (``fcntl.F_ADD_SEALS``)."""
    patch.delattr(fcntl, "F_ADD_SEALS")


def no_room(patch: Patcher) -> None:
    """No memfd, and no room for a file in the scratch directory (a full ``/dev/shm``)."""
    memfd_refused(patch)
    patch.setattr(os, "posix_fallocate", _no_room)


def no_posix_fallocate(patch: Patcher) -> None:
    """No ``os.posix_fallocate`` (macOS)."""
    patch.delattr(os, "posix_fallocate")


def no_dev_shm(patch: Patcher) -> None:
    """No ``/dev/shm`` (macOS)."""
    patch.setattr(os.path, "isdir", _hidden("/dev/shm", os.path.isdir, absent=False))


def no_proc(patch: Patcher) -> None:
    """No ``/proc`` (macOS, BSDs)."""
    patch.setattr(builtins, "open", _hidden("/proc", builtins.open))
    for name in ("listdir", "readlink", "scandir"):
        patch.setattr(os, name, _hidden("/proc", getattr(os, name)))


def no_sched(patch: Patcher) -> None:
    """No ``os.sched_*`` scheduling policies or CPU affinity (macOS)."""
    for name in ("sched_getscheduler", "sched_setscheduler", "sched_param", "SCHED_BATCH", "sched_getaffinity"):
        patch.delattr(os, name)


def no_sched_yield(patch: Patcher) -> None:
    """No ``os.sched_yield``: a spinning side only spins."""
    patch.delattr(os, "sched_yield")


def no_cgroup(patch: Patcher) -> None:
    """No cgroup v2 hierarchy (``/sys/fs/cgroup``), where a CPU quota would be read."""
    patch.setattr(builtins, "open", _hidden("/sys/fs/cgroup", builtins.open))


def sched_refused(patch: Patcher) -> None:
    """A kernel or sandbox that refuses to change the scheduling policy."""
    patch.setattr(os, "sched_setscheduler", _refused)


def no_scm_rights(patch: Patcher) -> None:
    """No passing of file descriptors over a socket (``SCM_RIGHTS``)."""
    for name in ("SCM_RIGHTS", "CMSG_SPACE", "CMSG_LEN", "send_fds", "recv_fds"):
        patch.delattr(socket, name)


def buffer_sizes_refused(patch: Patcher) -> None:
    """A system that refuses socket buffers above its maximum (``ENOBUFS``) instead of capping them as Linux does."""
    setsockopt = socket.socket.setsockopt

    def refusing(sock: socket.socket, level: int, option: int, *value: Any) -> None:
        if level == socket.SOL_SOCKET and option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            raise OSError(errno.ENOBUFS, "No buffer space available")
        setsockopt(sock, level, option, *value)

    patch.setattr(socket.socket, "setsockopt", refusing)


def no_prctl(patch: Patcher) -> None:
    """No ``prctl`` in the C library (``PR_SET_PDEATHSIG``)."""

    class WithoutPrctl(ctypes.CDLL):
        def __getattr__(self, name: str) -> Any:
            if name == "prctl":
                raise AttributeError(name)
            return super().__getattr__(name)

    patch.setattr(ctypes, "CDLL", WithoutPrctl)


PATCHES: dict[str, Callable[[Patcher], None]] = {
    patch.__name__: patch
    for patch in (
        no_memfd,
        memfd_refused,
        no_seals,
        no_room,
        no_posix_fallocate,
        no_dev_shm,
        no_proc,
        no_sched,
        no_sched_yield,
        no_cgroup,
        sched_refused,
        no_scm_rights,
        buffer_sizes_refused,
        no_prctl,
    )
}


def sitecustomize(names: list[str], marks: Path) -> str:
    """A ``sitecustomize`` module that applies the patches ``names``, then leaves a file named by its pid in ``marks``.

    Workers inherit the learner's ``sys.path``, so a folder holding it puts it in each of them.
    """
    return (
        "import os\n"
        "from tests.platform_patches import PATCHES, ForGood\n"
        f"for name in {names!r}:\n"
        "    PATCHES[name](ForGood())\n"
        f"open(os.path.join({str(marks)!r}, str(os.getpid())), 'w').close()\n"
    )
