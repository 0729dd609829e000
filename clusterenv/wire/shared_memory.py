"""Observations through shared memory, for workers on the learner's host.

Large observations (Atari frames: 100 KB per env per step) cost three extra copies on
the way through ZeroMQ: into the socket, out of it, and into the batch. When a worker
runs on the learner's host, the learner instead maps one file holding the batched
observation leaves, and each worker's ``SyncVectorEnv`` writes its slice of the batch
straight into it (``concatenate(..., out=...)``, the same code that fills its own buffer).
Only the signalling changes nothing: commands and replies (actions, rewards, flags,
infos) still travel on ZeroMQ, and a reply means the slice is written.

The file lives in a fresh ``0700`` directory (on ``/dev/shm`` where it exists) and is
unlinked as soon as the workers have mapped it; one left by a learner killed before
that is removed by the next learner to start (see ``cleanup``). A random token at its
start proves to a worker that it opened the learner's file (not a same-named one on
another host); a worker that cannot map it says so and keeps sending its observations
as frames.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
import shutil
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
from gymnasium import spaces

from clusterenv.wire.cleanup import scratch_dir, shared_memory_base
from clusterenv.wire.leaves import is_array_tree, leaf_specs, unflatten
from clusterenv.wire.messages import ShareObsMeta

__all__ = ["SHARED_OBS_MIN_BYTES", "SharedObservations", "attach", "bytes_per_env"]

logger = logging.getLogger(__name__)

# Below this many bytes per worker and step, frames are cheaper than a shared mapping is worth
# (pyzmq's own zero-copy threshold, zmq.COPY_THRESHOLD, is the same figure).
SHARED_OBS_MIN_BYTES = 64 * 1024
_TOKEN_BYTES = 16
_ALIGN = 64


def _layout(space: spaces.Space, num_envs: int) -> tuple[list[tuple[int, np.dtype, tuple[int, ...]]], int]:
    """``(offset, dtype, batched shape)`` of each leaf, cache-line aligned after the token, and the total size."""
    leaves, offset = [], _ALIGN
    for dtype, shape, _ in leaf_specs(space):
        batched = (num_envs, *shape)
        leaves.append((offset, dtype, batched))
        offset += -(-(math.prod(batched) * dtype.itemsize) // _ALIGN) * _ALIGN
    return leaves, offset


def _views(buffer: mmap.mmap, leaves: list[tuple[int, np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
    return [np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset) for offset, dtype, shape in leaves]


def bytes_per_env(space: spaces.Space) -> int:
    """Size of one env's observation across all leaves."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape, _ in leaf_specs(space))


class SharedObservations:
    """The learner's side: a mapped file holding the batched observations of all envs.

    Attributes:
        observations: the batch (a tree of arrays shaped like ``batch_space(space, num_envs)``),
            backed by the mapping; workers write their slices into it.
    """

    def __init__(self, space: spaces.Space, num_envs: int) -> None:
        if not is_array_tree(space):
            raise TypeError(f"Space {space} has no fixed array form; it cannot be shared.")
        self._leaves, size = _layout(space, num_envs)
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        directory = scratch_dir("obs", shared_memory_base())  # mode 0700
        self._remove_dir = weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)
        self.path = os.path.join(directory, "observations")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            # The views keep the mapping alive as long as any array (or a user's copy=False batch) refers to it.
            self._buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buffer[:_TOKEN_BYTES] = self._token
        self.observations = unflatten(space, _views(self._buffer, self._leaves))

    def meta(self, start: int, stop: int) -> ShareObsMeta:
        """What a worker running envs ``start..stop-1`` needs to map its slice."""
        return ShareObsMeta(
            path=self.path,
            token=self._token.hex(),
            size=len(self._buffer),
            leaves=[[offset, dtype.str, list(shape)] for offset, dtype, shape in self._leaves],
            start=start,
            stop=stop,
        )

    def unlink(self) -> None:
        """Remove the file; the mappings stay valid. Later workers (replacements) use frames."""
        self._remove_dir()


def attach(meta: Mapping[str, Any], space: spaces.Space) -> Any | None:
    """The worker's side: the worker's slice of the shared batch, or ``None`` if it cannot be mapped here."""
    try:
        fd = os.open(meta["path"], os.O_RDWR)
    except OSError as exc:
        logger.info("Shared observations at %s are not reachable (%s); sending frames instead.", meta["path"], exc)
        return None
    try:
        if os.fstat(fd).st_size != meta["size"]:
            return None
        buffer = mmap.mmap(fd, meta["size"])
    finally:
        os.close(fd)
    if buffer[:_TOKEN_BYTES] != bytes.fromhex(meta["token"]):
        logger.info("The file at %s is not this learner's shared observations; sending frames instead.", meta["path"])
        return None
    leaves = [(int(offset), np.dtype(dtype), tuple(shape)) for offset, dtype, shape in meta["leaves"]]
    num_envs = leaves[0][2][0] if leaves else 0
    start, stop = int(meta["start"]), int(meta["stop"])
    # The layout must be the one this worker's own space gives: never write outside of what the learner reads.
    if leaves != _layout(space, num_envs)[0] or _layout(space, num_envs)[1] != meta["size"]:
        return None
    if not 0 <= start < stop <= num_envs:
        return None
    return unflatten(space, [view[start:stop] for view in _views(buffer, leaves)])
