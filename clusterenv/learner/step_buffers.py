"""``BatchBuffers``: the learner's batch, written in place one worker slice at a time.

Array observations are written leaf by leaf into one batch (which may be memory the
workers on this host write directly, see ``shared_obs``); observations without a fixed
array form arrive pickled per env and are concatenated. Infos are replayed through
Gymnasium's own ``_add_info`` in env order, so the batch is what one ``SyncVectorEnv``
over all the envs would have returned.
"""

from __future__ import annotations

import logging
import platform
import socket
from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import concatenate, create_empty_array, iterate

from clusterenv.learner.pool import OnLoss, WorkerPool
from clusterenv.wire import shared_memory, step_region
from clusterenv.wire.infos import InfoPayload, InfoRecord, merge_infos, replay_infos
from clusterenv.wire.leaves import is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.messages import ResetMeta, ValueMeta, meta_of
from clusterenv.wire.protocol import STEP_FIELDS, Kind, Message, step_fields
from clusterenv.wire.step_region import StepRegion, fits

__all__ = [
    "WORKER_RESTARTED_KEY",
    "BatchBuffers",
    "report_cuts",
    "restarted_records",
    "share_steps",
    "share_with_local_workers",
]

logger = logging.getLogger(__name__)

#: The info key (with its ``_`` mask) flagging envs whose episode a worker restart cut short.
WORKER_RESTARTED_KEY = "worker_restarted"


def restarted_records(count: int, extra: Mapping[int, dict[str, Any]] | None = None) -> list[InfoRecord]:
    """The info records of ``count`` envs whose episodes a worker restart cut short, with each env's ``extra`` info."""
    extra = extra or {}
    return [(i, {**extra.get(i, {}), WORKER_RESTARTED_KEY: True}) for i in range(count)]


class BatchBuffers:
    """The observation, reward and done arrays of ``num_envs`` envs, filled from worker replies.

    ``observations`` and ``step_fields`` may be given: memory that workers on this host write
    (the shared step region's batch), where replies on the message path are written too.

    Attributes:
        observations: the batched observations (``observation_space``'s batch form).
        rewards, terminations, truncations: ``(num_envs,)`` float64 / bool / bool.
    """

    def __init__(
        self,
        space: spaces.Space,
        batch_space: spaces.Space,
        num_envs: int,
        loads: Callable[[bytes], Any],
        observations: Any = None,
        step_fields: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.space = space
        self.batch_space = batch_space
        self.num_envs = num_envs
        self.array_obs = is_array_tree(space)
        #: Unpickles workers' blobs (restricted for workers the learner did not start).
        self.loads = loads
        self.observations = create_empty_array(space, n=num_envs, fn=np.zeros) if observations is None else observations
        self._leaves = leaf_arrays(space, self.observations) if self.array_obs else []
        self._env_obs: list[Any] = [None] * num_envs
        if step_fields is None:
            step_fields = (
                np.zeros((num_envs,), dtype=np.float64),
                np.zeros((num_envs,), dtype=np.bool_),
                np.zeros((num_envs,), dtype=np.bool_),
            )
        self.rewards, self.terminations, self.truncations = step_fields

    def write_observations(self, sl: slice, msg: Message, n_extra: int) -> None:
        """Write one worker's observations (all but its last ``n_extra`` arrays) into the batch."""
        if not self.array_obs:
            self._env_obs[sl] = self.loads(msg.blobs[1])
            return
        obs_arrays = msg.arrays[: len(msg.arrays) - n_extra]
        if obs_arrays:  # else the worker wrote its slice into the shared batch
            for leaf, part in zip(self._leaves, obs_arrays, strict=True):
                leaf[sl] = part

    def collect(self, replies: Iterable[tuple[slice, Message]], step: bool) -> dict[str, Any]:
        """Write each ``(slice, reply)`` (in env order) into the batch and return the infos, replayed in env order."""
        infos: dict[str, Any] = {}
        n_extra = len(STEP_FIELDS) if step else 0
        for sl, msg in replies:
            if not self.array_obs or len(msg.arrays) > n_extra:  # else written into the batch already
                self.write_observations(sl, msg, n_extra)
            if step:
                rewards, terminations, truncations = step_fields(msg)
                if rewards.base is not self.rewards:  # else the worker wrote them into the batch itself
                    self.rewards[sl], self.terminations[sl], self.truncations[sl] = rewards, terminations, truncations
            payload = msg.infos if msg.infos is not None else self.infos_of(msg)
            if payload:
                infos = merge_infos(infos, payload, self.num_envs, sl.start)
        if not self.array_obs:
            self.finish()
        return infos

    def infos_of(self, msg: Message) -> InfoPayload:
        """A reply's infos: decoded already (from shared memory), else unpickled from its first blob (none: ``[]``)."""
        if msg.infos is not None:
            return msg.infos
        return self.loads(msg.blobs[0]) if msg.blobs[0] else []

    def finish(self) -> None:
        """Concatenate per-env observations after a round of writes (array observations need nothing)."""
        if not self.array_obs:
            self.observations = concatenate(self.space, self._env_obs, self.observations)  # type: ignore[arg-type]

    def observation_batch(self, copy: bool) -> Any:
        """The batch as ``reset``/``step`` return it: a fresh copy, or with ``copy=False`` the buffer itself."""
        if not copy:
            return self.observations
        if type(self.observations) is np.ndarray and self.observations.dtype != object:
            return self.observations.copy()  # what deepcopy does for a numeric array, without its memo bookkeeping
        return deepcopy(self.observations)

    def step_batch(
        self, copy: bool, infos: dict[str, Any]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """What ``step`` returns: the observations (see :meth:`observation_batch`), copies of the rest, ``infos``."""
        return (
            self.observation_batch(copy),
            self.rewards.copy(),
            self.terminations.copy(),
            self.truncations.copy(),
            infos,
        )

    def last_observations(self, sl: slice) -> list[Any]:
        """Copies of the observations of envs ``sl``, one per env (the ``final_obs`` of cut episodes)."""
        every = list(iterate(self.batch_space, self.observations)) if self.array_obs else self._env_obs
        return [deepcopy(obs) for obs in every[sl]]

    def cut_short(
        self, infos: dict[str, Any], sl: slice, reset: Message | None, final_obs: list[Any] | None = None
    ) -> dict[str, Any]:
        """Report the episodes of envs ``sl``, cut short by a worker restart, as truncations.

        Reward 0, ``terminated=False``, ``truncated=True`` and ``infos["worker_restarted"]``. With
        the replacement's ``reset`` reply (SAME_STEP) its observations start the new episode
        here, ``final_obs`` is the last observation received (taken before the reset, where the
        replacement resets into the batch itself) and ``final_info`` empty.
        """
        self.rewards[sl], self.terminations[sl], self.truncations[sl] = 0.0, False, True
        extra: list[dict[str, Any]] = [{} for _ in range(sl.stop - sl.start)]
        if reset is not None:
            final_obs = self.last_observations(sl) if final_obs is None else final_obs
            self.write_observations(sl, reset, n_extra=0)
            reset_infos: dict[int, dict[str, Any]] = dict(self.loads(reset.blobs[0])) if reset.blobs[0] else {}
            for i in range(len(extra)):
                extra[i] = {"final_obs": final_obs[i], "final_info": {}, **reset_infos.get(i, {})}
        return replay_infos(infos, restarted_records(len(extra), dict(enumerate(extra))), self.num_envs, sl.start)

    def detach(self) -> None:
        """Hold private copies of the batch from now on (after close: the workers' shared memory can go)."""
        self.observations = self.observation_batch(copy=True) if self.array_obs else self.observations
        self._leaves = leaf_arrays(self.space, self.observations) if self.array_obs else []
        self.rewards, self.terminations, self.truncations = (
            self.rewards.copy(),
            self.terminations.copy(),
            self.truncations.copy(),
        )

    def rows(self, env_ids: np.ndarray) -> Any:
        """A fresh batch of the observations of envs ``env_ids``, in that order (first-ready batches)."""
        if self.array_obs:
            return unflatten(self.space, [leaf[env_ids] for leaf in self._leaves])
        empty: Any = create_empty_array(self.space, n=len(env_ids), fn=np.zeros)
        return concatenate(self.space, [self._env_obs[i] for i in env_ids], empty)


def report_cuts(
    buffers: BatchBuffers,
    pool: WorkerPool,
    slices: list[slice],
    infos: dict[str, Any],
    interrupted: list[int],
    same_step: bool,
    timeout: float | None,
) -> dict[str, Any]:
    """Report the episodes that a worker restart cut short as truncations (docs/guides/fault-tolerance.md).

    Reward 0, ``truncated=True``, ``infos["worker_restarted"]``. SAME_STEP (``same_step``): the envs are reset here
    (``final_obs`` the last observation received, ``final_info`` empty); NEXT_STEP: the last observation, the next
    step resets. ``interrupted``: the workers whose envs were cut, ``slices`` their envs.
    """
    resets: dict[int, Message] = {}
    last: dict[int, list[Any]] = {}
    if same_step:
        # Taken first: a worker on the shared step path resets into the batch itself.
        last = {w: buffers.last_observations(slices[w]) for w in interrupted}
        meta = ResetMeta(seeds=None, mask=None)
        resets = pool.request(interrupted, Kind.RESET, meta, "resetting a replacement's envs", timeout)
    for w in interrupted:
        infos = buffers.cut_short(infos, slices[w], resets.get(w), last.get(w))
    buffers.finish()
    return infos


def share_with_local_workers(pool: WorkerPool, space: spaces.Space, slices: list[slice], timeout: float) -> Any:
    """A batch in memory shared with the workers on this host, if observations are large enough to pay; else None.

    Workers that map it write their slices there and leave them out of their replies
    (see ``shared_obs``); the others, and any replacement worker, keep sending frames.
    """
    if not is_array_tree(space):
        return None
    if (
        min(sl.stop - sl.start for sl in slices) * shared_memory.bytes_per_env(space)
        < shared_memory.SHARED_OBS_MIN_BYTES
    ):
        return None
    host = socket.gethostname()
    local = [w for w in range(len(slices)) if pool.members.host(w) == host]
    if not local:
        return None
    shared = shared_memory.SharedObservations(space, slices[-1].stop)
    try:
        pool.new_call()
        for w in local:
            pool.send(w, Kind.SHARE_OBS, shared.meta(slices[w].start, slices[w].stop), on_loss=OnLoss.RAISE)
        replies = pool.gather(local, "mapping shared observations", timeout)
    finally:
        shared.unlink()
    attached = sorted(w for w, reply in replies.items() if meta_of(reply, ValueMeta).get("attached"))
    logger.debug("Workers %s write observations into shared memory at %s.", attached, shared.path)
    return shared.observations


def share_steps(
    pool: WorkerPool,
    observation_space: spaces.Space,
    action_space: spaces.Space,
    slices: list[slice],
    timeout: float,
    spin_us: float | None = None,
) -> StepRegion | None:
    """The shared step region, if workers on this host step through it (else ``None``).

    Workers the learner started on this host, on pipes, whose spaces have a fixed array form
    (:mod:`clusterenv.wire.step_region`); the region's observations are the batch, and the
    others keep the message path and send their observations as frames, written into it.
    Where no file for the region can be made (no memfd, and no room for a file in a scratch directory),
    every worker keeps the message path, and a warning says so; so does every worker on a CPU other
    than x86 (:data:`~clusterenv.wire.step_region.ORDERED_MEMORY`).
    """
    if not fits(observation_space, action_space) or not any(pool.can_wake(w) for w in range(len(slices))):
        return None
    if not step_region.ORDERED_MEMORY:
        logger.info(
            "Every worker keeps the message path: the shared step region relies on x86's memory order, and this "
            "CPU is %s.",
            platform.machine(),
        )
        return None
    try:
        region = StepRegion(observation_space, action_space, slices)
    except OSError as exc:
        logger.warning("The shared step region could not be made here (%s); every worker keeps the message path.", exc)
        return None
    on_path = pool.share_steps(region, timeout, spin_us)
    if not on_path:
        return None
    logger.debug("Workers %s write observations into shared memory and step through it.", sorted(on_path))
    return region
