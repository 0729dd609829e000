"""The file behind the shared step region: a sealed ``memfd`` where there is one, else an unlinked file.

The learner maps the region and so do its local workers, each through its own copy of the
file's descriptor (:mod:`clusterenv.wire.step_region`). A process holding such a copy could
shrink the file under the learner's mapping, and the learner's next touch of a page past the
new end would kill it with ``SIGBUS`` (no exception, no cleanup). On Linux the file is a
``memfd`` created with ``MFD_ALLOW_SEALING`` and sealed against shrinking and growing, and
against any further seal, before any worker gets it: a truncation then fails with ``EPERM``
in whoever tries it, and the learner's mapping stays whole.

Where ``os.memfd_create`` is missing (macOS) or refused (a seccomp sandbox), the region is a
file in a fresh ``0700`` directory of the learner's (on ``/dev/shm`` where it exists),
unlinked with its directory as soon as it is open, so nothing is left behind either. Such a
file cannot be sealed: a worker process could truncate it through its copy of the
descriptor. Local workers run env code as the learner's own user, which could as well
signal the learner, so this only matters where that code is less trusted than the learner.
Where even that file cannot be made, the caller keeps the message path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from dataclasses import dataclass

from clusterenv.wire.cleanup import scratch_dir, shared_memory_base

__all__ = ["MEMFD_NAME", "RegionFile", "open_region_file"]

logger = logging.getLogger(__name__)

#: The memfd's name (``/proc/PID/fd/N`` reads ``/memfd:clusterenv-steps (deleted)``).
MEMFD_NAME = "clusterenv-steps"


@dataclass(frozen=True)
class RegionFile:
    """An open, sized, nameless file for the region.

    Attributes:
        fd: the learner's descriptor (close-on-exec; passed to workers over their wake sockets).
        sealed: whether its size is sealed (a memfd), so that no holder can shrink or grow it.
    """

    fd: int
    sealed: bool


def open_region_file(size: int) -> RegionFile:
    """A file of ``size`` bytes for the region: a sealed memfd, else an unlinked private file (and a log line).

    Raises:
        OSError: neither could be made (no writable scratch directory, or no room in it); the caller
            keeps the message path.
    """
    try:
        return RegionFile(_sealed_memfd(size), sealed=True)
    except (AttributeError, OSError) as exc:  # AttributeError: no memfd_create, MFD_ALLOW_SEALING or F_ADD_SEALS
        why = f"{type(exc).__name__}: {exc}"
    fd, base = _unlinked_file(size)
    logger.info(
        "A sealed memfd could not be made here (%s); the shared step region is an unlinked file in %s instead, "
        "which cannot be sealed against a local worker resizing it.",
        why,
        base,
    )
    return RegionFile(fd, sealed=False)


def _sealed_memfd(size: int) -> int:
    """A memfd of ``size`` bytes whose size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``)."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlinked_file(size: int) -> tuple[int, str]:
    """A file of ``size`` bytes opened in a fresh private directory, both removed at once; and where it was."""
    base = shared_memory_base()
    directory = scratch_dir("steps", base)  # mode 0700; one left by a crash here is removed as stale
    try:
        path = os.path.join(directory, "region")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # not inheritable
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):  # not on macOS
            # Its pages now: on a full file system (a container's /dev/shm is 64 MB by default) a
            # page written later could not be had, and touching it would kill the learner with SIGBUS.
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd, os.path.dirname(directory)
