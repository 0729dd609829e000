"""``ClusterEnv``: a Gymnasium ``VectorEnv`` whose sub-environments live in worker processes."""

from __future__ import annotations

import contextlib
import logging
import os
import socket as pysocket
import time
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
from gymnasium import Env
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array, iterate

from clusterenv import shared_obs
from clusterenv.batching import is_array_tree, leaf_arrays, leaf_specs, replay_infos, split_evenly, unflatten
from clusterenv.errors import WorkerTimeoutError
from clusterenv.launch import Launcher
from clusterenv.liveness import Heartbeat
from clusterenv.pool import Command, WorkerPool, weak_callback
from clusterenv.protocol import Kind, Message
from clusterenv.validation import (
    check_actions,
    check_attribute_name,
    check_batch_size,
    check_env_fns,
    check_num_workers,
    check_procs_per_worker,
    check_reset_options,
    check_seconds,
    check_seeds,
    per_env_values,
    pickle_argument,
    pickle_env_fn,
)

__all__ = ["WORKER_RESTARTED_KEY", "ClusterEnv"]

logger = logging.getLogger(__name__)

_CLOSE_GRACE_S = 5.0
#: The info key (with its ``_`` mask) flagging envs whose episode a worker restart cut short.
WORKER_RESTARTED_KEY = "worker_restarted"


def _rows(leaf: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``leaf[rows]``, as a view when the rows are consecutive (the usual case: env_ids as recv() gave them)."""
    start = int(rows[0])
    if len(rows) == 1 or (rows[-1] - start == len(rows) - 1 and (len(rows) == 2 or (np.diff(rows) == 1).all())):
        return leaf[start : start + len(rows)]
    return leaf[rows]


def _default_num_workers(num_envs: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, num_envs))


class ClusterEnv(VectorEnv):
    """A vector env whose ``reset``/``step`` run in worker processes over ZeroMQ.

    The envs are split into contiguous slices, one per worker; each worker steps its
    slice as a ``SyncVectorEnv`` (or, with ``procs_per_worker > 1``, as several of them
    in its own child processes), so results are bit-identical to
    ``gymnasium.vector.SyncVectorEnv`` with the same seeds and actions, in every
    autoreset mode. Actions and observations travel as raw array frames; env factories
    travel once, cloudpickled, after the worker has authenticated.

    Example:
        >>> import gymnasium as gym
        >>> from clusterenv import ClusterEnv
        >>> envs = ClusterEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=2)
        >>> obs, infos = envs.reset(seed=42)
        >>> obs.shape
        (4, 4)
        >>> envs.close()
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env]],
        *,
        num_workers: int | None = None,
        procs_per_worker: int = 1,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        copy: bool = True,
        observation_mode: str = "same",
        timeout: float | None = 60.0,
        start_timeout: float = 120.0,
        bind: str | None = None,
        secret: str | bytes | None = None,
        launcher: Launcher | str | None = None,
        on_worker_failure: str = "raise",
        heartbeat: Heartbeat | None = None,
        batch_size: int | None = None,
        trusted_classes: Sequence[type | str] = (),
        encrypt: bool = False,
    ) -> None:
        """Start the workers and build the envs in them.

        Args:
            env_fns: zero-argument callables creating the environments, as for ``AsyncVectorEnv``.
            num_workers: worker processes; defaults to one per available core, at most ``len(env_fns)``.
                Each worker is one ZeroMQ peer of the learner.
            procs_per_worker: env processes per worker. With ``N > 1`` each worker splits its
                slice over ``min(N, slice size)`` child processes that step in parallel, so one
                worker per host can use all its cores while the learner talks to one peer per
                host (its cost grows with hosts, not processes). Results are unchanged. A
                worker started with ``clusterenv-worker --procs N`` uses its own ``N``.
            autoreset_mode: Gymnasium's autoreset mode, applied inside the workers.
            copy: return fresh observation arrays from ``reset``/``step`` (else a reused buffer).
            observation_mode: ``"same"`` or ``"different"``, as for ``SyncVectorEnv``.
            timeout: seconds to wait for a reply before raising ``WorkerTimeoutError`` (None: forever).
                A timeout closes the env: the late workers are still busy with a call whose
                result nobody will read, so their envs are in an unknown state.
            start_timeout: seconds to wait for workers to join and build their envs.
            bind: learner address; ``None`` is a private ``ipc://`` socket. Non-loopback
                addresses require a ``secret``.
            secret: shared HMAC secret (or ``$CLUSTERENV_SECRET``); random when workers are local.
            launcher: what starts the workers: ``"local"`` child processes (default), ``"external"``
                (started by hand or ``srun``, see docs/cluster.md), ``"ray"``, or a ``Launcher``.
            on_worker_failure: ``"raise"`` a ``WorkerLostError``, or ``"restart"`` the worker: its envs
                are rebuilt and report the interrupted episode as truncated, with
                ``infos["worker_restarted"]`` set (exact semantics in docs/cluster.md).
            heartbeat: heartbeat constants; a worker whose heartbeat connection carried nothing for
                ``interval * liveness`` seconds (dead or frozen, not busy) is lost.
            batch_size: how many envs :meth:`recv` returns (default ``num_envs``): those of the
                ``batch_size // envs_per_worker`` workers that are ready first. Needs equal slices
                (``num_envs`` a multiple of ``num_workers``) and a multiple of the envs per worker.
            trusted_classes: classes (or ``"module.Name"`` strings) that infos, observations, call
                results and errors from workers the learner did not start itself (``launcher="external"``,
                Ray) may contain beyond plain data; anything else raises ``UntrustedPickleError``
                (see docs/cluster.md, Security). Workers it starts itself are not restricted.
            encrypt: encrypt all traffic with CurveZMQ, keys derived from the secret; a peer
                without the secret then cannot even connect. External workers need
                ``clusterenv-worker --encrypt``.
        """
        super().__init__()
        self._state = AsyncState.DEFAULT
        self._holder: str | None = None  # an extension holding the pending call (a prefetching runner)
        self.closed = True  # until the workers are up, close() has nothing to do
        check_env_fns(env_fns)
        self.num_envs = len(env_fns)
        if num_workers is None:
            num_workers = _default_num_workers(self.num_envs)
        self.num_workers = num_workers = check_num_workers(num_workers, self.num_envs)
        self.procs_per_worker = check_procs_per_worker(procs_per_worker)
        try:
            self.autoreset_mode = AutoresetMode(autoreset_mode)
        except ValueError:
            raise ValueError(
                f"`autoreset_mode` must be one of {[mode.value for mode in AutoresetMode]}, got {autoreset_mode!r}."
            ) from None
        if observation_mode not in ("same", "different"):
            raise ValueError(f"`observation_mode` must be 'same' or 'different', got {observation_mode!r}.")
        self.copy = copy
        self.timeout = check_seconds("timeout", timeout, allow_none=True)
        start_timeout = check_seconds("start_timeout", start_timeout, allow_none=False)
        if on_worker_failure not in ("raise", "restart"):
            raise ValueError(f"`on_worker_failure` must be 'raise' or 'restart', got {on_worker_failure!r}.")
        self.on_worker_failure = on_worker_failure
        self.heartbeat = Heartbeat() if heartbeat is None else heartbeat
        pickled_fns = [pickle_env_fn(i, fn) for i, fn in enumerate(env_fns)]

        self._slices = split_evenly(self.num_envs, num_workers)
        self._batch_size = check_batch_size(batch_size, self.num_envs, num_workers)
        # First-ready batches: which workers are stepping (and what), which replied and wait for recv().
        self._in_flight: dict[int, str] = {}
        self._arrived: list[tuple[int, str, Message]] = []
        self._action_spaces: dict[int, Any] = {}
        self._observation_mode = observation_mode

        self._pool = WorkerPool(
            num_workers,
            bind=bind,
            secret=secret,
            launcher=launcher,
            heartbeat=self.heartbeat,
            on_worker_failure=on_worker_failure,
            start_timeout=start_timeout,
            describe_work=lambda w: f"envs {self._slices[w].start}..{self._slices[w].stop - 1}",
            trusted_classes=trusted_classes,
            encrypt=encrypt,
        )
        # Weak: the pool must not keep the env alive (its finalizer ends the workers).
        self._pool.on_fatal = weak_callback(self._close_after_error)
        self.address = self._pool.address
        self._needs_reset = True
        self.closed = False
        try:
            self._pool.start()
            self._init_workers(pickled_fns, observation_mode, start_timeout)
        except BaseException:
            self.close(terminate=True)
            raise

        self._obs_leaves = leaf_arrays(self.single_observation_space, self._observations) if self._array_obs else []
        self._env_obs: list[Any] = [None] * self.num_envs
        self._rewards = np.zeros((self.num_envs,), dtype=np.float64)
        self._terminations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._truncations = np.zeros((self.num_envs,), dtype=np.bool_)
        self._action_specs = leaf_specs(self.single_action_space) if is_array_tree(self.single_action_space) else None
        self._env_worker = np.repeat(np.arange(num_workers), [sl.stop - sl.start for sl in self._slices])
        self._pool.restart_hooks.append(weak_callback(self._reset_replacement_in_flight))

    @property
    def batch_size(self) -> int:
        """How many envs :meth:`recv` returns; may be changed while no env is in flight."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        if self._streaming_workers():
            raise AlreadyPendingCallError(
                "Cannot change `batch_size` while envs are in flight: recv() them first.", "step"
            )
        self._batch_size = check_batch_size(value, self.num_envs, self.num_workers)

    # -- the seam for extensions (PolicyRunner) ---------------------------------------------
    @property
    def pool(self) -> WorkerPool:
        """The worker pool, for extensions that send their own commands inside :meth:`pending_call`."""
        return self._pool

    @property
    def worker_slices(self) -> tuple[slice, ...]:
        """The envs of each worker: worker ``w`` steps envs ``worker_slices[w]`` (global indices)."""
        return tuple(self._slices)

    @property
    def needs_reset(self) -> bool:
        """True until the first ``reset``: stepping before it raises ``ResetNeeded``."""
        return self._needs_reset

    @contextlib.contextmanager
    def pending_call(self, holder: str | None = None) -> Iterator[WorkerPool]:
        """Hold the env's one pending call while an extension talks to the workers through the pool.

        Inside, ``reset``/``step``/``call`` raise ``AlreadyPendingCallError`` (naming ``holder``,
        if given); the pool's sequence number is new, so replies to earlier calls are ignored.
        """
        self._begin(AsyncState.WAITING_CALL)
        self._state, self._holder = AsyncState.WAITING_CALL, holder
        try:
            yield self._pool
        finally:
            self._state, self._holder = AsyncState.DEFAULT, None

    # -- construction ----------------------------------------------------------------------
    def _init_workers(self, pickled_fns: list[bytes], observation_mode: str, timeout: float) -> None:
        self._pool.new_call()
        for w, sl in enumerate(self._slices):
            meta = {
                "env_offset": sl.start,
                "autoreset_mode": self.autoreset_mode.value,
                "observation_mode": observation_mode,
                "procs_per_worker": self.procs_per_worker,
            }
            self._pool.send_init(w, meta, pickled_fns[sl])
        replies = self._pool.gather(range(self.num_workers), "building envs", timeout)
        descriptions = [self._pool.loads(replies[w].blobs[0]) for w in range(self.num_workers)]
        obs_spaces = [s for d in descriptions for s in d["observation_spaces"]]
        action_spaces = [s for d in descriptions for s in d["action_spaces"]]

        self.metadata = dict(descriptions[0]["metadata"])
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = descriptions[0]["render_mode"]
        self.single_observation_space = obs_spaces[0]
        self.single_action_space = action_spaces[0]
        for i, space in enumerate(action_spaces):
            if space != self.single_action_space:
                raise RuntimeError(
                    f"Sub-environment {i} has action space {space}, but env 0 has {self.single_action_space}."
                )
        if observation_mode == "same":
            for i, space in enumerate(obs_spaces):
                if space != self.single_observation_space:
                    raise RuntimeError(
                        f"ClusterEnv(..., observation_mode='same') but env {i} has observation space {space} "
                        f"and env 0 has {self.single_observation_space}. Use observation_mode='different'."
                    )
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        else:
            self.observation_space = batch_differing_spaces(obs_spaces)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._array_obs = is_array_tree(self.single_observation_space)
        self._observations = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        self._share_observations(observation_mode, timeout)

    def _share_observations(self, observation_mode: str, timeout: float) -> None:
        """Put the observation batch in memory shared with the workers on this host, if large enough to pay.

        Workers that map it write their slices there and leave them out of their replies
        (see ``shared_obs``); the others, and any replacement worker, keep sending frames.
        """
        if not self._array_obs or observation_mode != "same":
            return
        smallest = min(sl.stop - sl.start for sl in self._slices)
        if smallest * shared_obs.bytes_per_env(self.single_observation_space) < shared_obs.SHARED_OBS_MIN_BYTES:
            return
        host = pysocket.gethostname()
        local = [w for w in range(self.num_workers) if self._pool.host(w) == host]
        if not local:
            return
        shared = shared_obs.SharedObservations(self.single_observation_space, self.num_envs)
        try:
            self._pool.new_call()
            for w in local:
                self._pool.send(w, Kind.SHARE_OBS, shared.meta(self._slices[w].start, self._slices[w].stop))
            replies = self._pool.gather(local, "mapping shared observations", timeout)
        finally:
            shared.unlink()
        self._observations = shared.observations
        attached = sorted(w for w, reply in replies.items() if reply.meta.get("attached"))
        logger.debug("Workers %s write observations into shared memory at %s.", attached, shared.path)

    def _begin(self, state: AsyncState) -> None:
        self._assert_is_running()
        if streaming := self._streaming_workers():
            raise AlreadyPendingCallError(
                f"Calling `{state.value}` while {len(streaming)} workers' envs are in "
                "flight from async_reset()/send(): recv() them all first.",
                "step",
            )
        if self._state != AsyncState.DEFAULT:
            if self._holder is not None:
                raise AlreadyPendingCallError(
                    f"Calling `{state.value}` while the envs are held by {self._holder}.", "call"
                )
            raise AlreadyPendingCallError(
                f"Calling `{state.value}` while waiting for a pending call to `{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._pool.new_call()

    def _end(self, state: AsyncState, name: str) -> None:
        self._assert_is_running()
        if self._state != state:
            raise NoAsyncCallError(f"Calling `{name}` without any prior matching async call.", state.value)

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(f"Trying to operate on `{type(self).__name__}`, after a call to `close()`.")

    # -- reset -----------------------------------------------------------------------------
    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the envs (all, or those in ``options["reset_mask"]``), like ``SyncVectorEnv.reset``."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Send the reset to the workers without waiting for the observations."""
        self._begin(AsyncState.WAITING_RESET)
        seeds = check_seeds(seed, self.num_envs)
        options, mask = check_reset_options(options, self.num_envs)
        blobs = [] if options is None else [pickle_argument(options, "`options` of reset")]
        commands: dict[int, Command] = {
            w: ({"seeds": seeds[sl], "mask": None if mask is None else mask[sl].tolist()}, (), blobs)
            for w, sl in enumerate(self._slices)
            if mask is None or mask[sl].any()
        }
        self._pool.send_each(Kind.RESET, commands)  # all or none: a partial reset would desynchronize the envs
        self._pending = list(commands)
        if mask is None:
            self._rewards[:] = 0.0
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the observations of a ``reset_async``; ``timeout`` defaults to the env's."""
        self._end(AsyncState.WAITING_RESET, "reset_wait")
        replies = self._pool.gather(self._pending, "resetting", self.timeout if timeout is None else timeout)
        self._state = AsyncState.DEFAULT
        self._needs_reset = False
        infos = self._collect(replies, n_extra=0)
        return self._observation_batch(), infos

    # -- step ------------------------------------------------------------------------------
    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env with its action; returns batched ``(obs, rewards, terminations, truncations, infos)``."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send the actions to the workers without waiting for the results."""
        self._assert_is_running()
        if self._needs_reset:
            raise ResetNeeded("Cannot call `step` before `reset`: the environments have not been reset yet.")
        self._begin(AsyncState.WAITING_STEP)
        if self._action_specs is None:
            raise TypeError(f"Action space {self.single_action_space} has no fixed array form; it is not supported.")
        leaves = check_actions(actions, self.action_space, self._action_specs, self.num_envs)
        self._pool.send_each(
            Kind.STEP, {w: (None, [leaf[sl] for leaf in leaves], ()) for w, sl in enumerate(self._slices)}
        )
        self._pending = list(range(self.num_workers))
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for the results of a ``step_async``; ``timeout`` defaults to the env's."""
        self._end(AsyncState.WAITING_STEP, "step_wait")
        replies = self._pool.gather(self._pending, "stepping", self.timeout if timeout is None else timeout)
        self._state = AsyncState.DEFAULT
        infos = self._collect(replies, n_extra=3)
        if self._pool.interrupted:
            infos = self._report_interrupted(infos)
        return (
            self._observation_batch(),
            np.copy(self._rewards),
            np.copy(self._terminations),
            np.copy(self._truncations),
            infos,
        )

    def _collect(self, replies: dict[int, Message], n_extra: int) -> dict[str, Any]:
        """Write the workers' slices into the batch buffers and replay infos in env order."""
        infos: dict[str, Any] = {}
        for w in sorted(replies):
            sl, msg = self._slices[w], replies[w]
            self._write_slice(sl, msg, n_extra)
            if n_extra:
                rewards, terminations, truncations = msg.arrays[-3:]
                self._rewards[sl], self._terminations[sl], self._truncations[sl] = rewards, terminations, truncations
            if msg.blobs[0]:
                infos = replay_infos(infos, self._pool.loads(msg.blobs[0]), self.num_envs, sl.start)
        self._finish_observations()
        return infos

    def _write_slice(self, sl: slice, msg: Message, n_extra: int) -> None:
        """Write one worker's observations (all but its last ``n_extra`` arrays) into the batch."""
        if not self._array_obs:
            self._env_obs[sl] = self._pool.loads(msg.blobs[1])
            return
        obs_arrays = msg.arrays[: len(msg.arrays) - n_extra]
        if obs_arrays:  # else the worker wrote its slice into the shared batch
            for leaf, part in zip(self._obs_leaves, obs_arrays, strict=True):
                leaf[sl] = part

    def _finish_observations(self) -> None:
        if not self._array_obs:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)  # type: ignore[arg-type]

    def _report_interrupted(self, infos: dict[str, Any]) -> dict[str, Any]:
        """Report the episodes that a worker restart cut short as truncations (semantics in docs/cluster.md).

        Reward 0, ``terminated=False``, ``truncated=True`` and ``infos["worker_restarted"]``.
        Under SAME_STEP the new episode starts now: the replacement's envs are reset here, the
        observation is the reset one, ``final_obs`` the last one received and ``final_info`` empty.
        Under NEXT_STEP the observation is the last one received, and the next step resets.
        """
        interrupted = sorted(self._pool.interrupted)
        self._pool.interrupted.clear()
        resets: dict[int, Message] = {}
        if self.autoreset_mode is AutoresetMode.SAME_STEP:
            meta = {"seeds": None, "mask": None}
            resets = self._pool.request(interrupted, Kind.RESET, meta, "resetting a replacement's envs", self.timeout)
        for w in interrupted:
            sl = self._slices[w]
            self._rewards[sl], self._terminations[sl], self._truncations[sl] = 0.0, False, True
            extra: list[dict[str, Any]] = [{} for _ in range(sl.stop - sl.start)]
            if w in resets:
                every = list(iterate(self.observation_space, self._observations)) if self._array_obs else self._env_obs
                final_obs = [deepcopy(obs) for obs in every[sl]]
                self._write_slice(sl, resets[w], n_extra=0)
                blob = resets[w].blobs[0]
                reset_infos: dict[int, dict[str, Any]] = dict(self._pool.loads(blob)) if blob else {}
                for i in range(len(extra)):
                    extra[i] = {"final_obs": final_obs[i], "final_info": {}, **reset_infos.get(i, {})}
            records = [(i, {**info, WORKER_RESTARTED_KEY: True}) for i, info in enumerate(extra)]
            infos = replay_infos(infos, records, self.num_envs, sl.start)
        self._finish_observations()
        return infos

    def _observation_batch(self) -> Any:
        if not self.copy:
            return self._observations
        if type(self._observations) is np.ndarray and self._observations.dtype != object:
            return self._observations.copy()  # what deepcopy does for a numeric array, without its memo bookkeeping
        return deepcopy(self._observations)

    # -- first-ready batches (EnvPool's async_reset / send / recv) --------------------------
    def async_reset(self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> None:
        """Reset every env without waiting; :meth:`recv` returns them ``batch_size`` at a time, first ready first.

        Each env's trajectory is exactly that of the same env stepped alone with its seed
        (``seed + i`` for env ``i``) and the actions :meth:`send` gives it.
        """
        if self.autoreset_mode is AutoresetMode.DISABLED:
            raise ValueError(
                "async_reset/send/recv need an autoreset mode (NEXT_STEP or SAME_STEP): under DISABLED an "
                "env that ended can only be reset with reset(options={'reset_mask': ...}), which waits for all envs."
            )
        if options is not None and "reset_mask" in options:
            raise ValueError("async_reset() resets every env; `options['reset_mask']` is for reset().")
        self._check_first_ready()
        self.reset_async(seed=seed, options=options)
        self._state, self._needs_reset = AsyncState.WAITING_STEP, False
        self._in_flight = dict.fromkeys(self._pending, "reset")

    def send(self, actions: Any, env_ids: Any) -> None:
        """Step the envs ``env_ids`` (whole workers, as :meth:`recv` returned them) with ``actions``, without waiting.

        ``actions[j]`` is the action of env ``env_ids[j]``.
        """
        self._assert_is_running()
        self._check_first_ready()
        if self._needs_reset:
            raise ResetNeeded("Cannot call `send` before a reset: call async_reset() (or reset()) first.")
        if self._action_specs is None:
            raise TypeError(f"Action space {self.single_action_space} has no fixed array form; it is not supported.")
        env_ids = np.asarray(env_ids)
        if env_ids.ndim != 1 or env_ids.dtype.kind not in "iu" or not len(env_ids):
            raise ValueError(f"`env_ids` must be a non-empty 1-d array of env indices, got {env_ids!r}.")
        if env_ids.min() < 0 or env_ids.max() >= self.num_envs or len(np.unique(env_ids)) != len(env_ids):
            raise ValueError(f"`env_ids` must be distinct indices in [0, {self.num_envs}), got {env_ids.tolist()}.")
        position = np.full(self.num_envs, -1)
        position[env_ids] = np.arange(len(env_ids))
        workers = np.unique(self._env_worker[env_ids]).tolist()
        streaming = self._streaming_workers()
        busy = sorted(set(workers).intersection(streaming))
        if busy:
            raise ValueError(
                f"`env_ids` include envs of workers {busy} whose last results recv() has not returned yet: "
                "send() takes the envs that recv() returned."
            )
        rows = [position[self._slices[w]] for w in workers]
        partial = [w for w, r in zip(workers, rows, strict=True) if (r < 0).any()]
        if partial:
            sl = self._slices[partial[0]]
            raise ValueError(
                f"`env_ids` must hold whole workers' envs, as recv() returns them: worker {partial[0]} steps "
                f"envs {sl.start}..{sl.stop - 1}, but only some of them were given."
            )
        space = self._action_space_for(len(env_ids))
        leaves = check_actions(actions, space, self._action_specs, len(env_ids))
        if not streaming:
            self._begin(AsyncState.WAITING_STEP)
            self._state = AsyncState.WAITING_STEP
        commands: dict[int, Command] = {
            w: (None, [_rows(leaf, r) for leaf in leaves], ()) for w, r in zip(workers, rows, strict=True)
        }
        self._pool.send_each(Kind.STEP, commands)
        self._in_flight.update(dict.fromkeys(workers, "step"))

    def recv(
        self, timeout: float | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any], np.ndarray]:
        """The results of the first ``batch_size`` envs to be ready: ``(obs, rewards, terminations, truncations, infos, env_ids)``.

        That is the envs of the first ``batch_size // envs_per_worker`` workers to reply, in the
        order they replied; row ``j`` is env ``env_ids[j]``, and infos are batched over the rows.
        After :meth:`async_reset`, rewards are 0 and terminations and truncations False.
        A ``timeout`` (default: the env's) raises ``WorkerTimeoutError``; the envs stay in flight.
        """
        self._assert_is_running()
        needed = self.num_workers * self._batch_size // self.num_envs  # exact: whole workers
        streaming = self._streaming_workers()
        if len(streaming) < needed:
            waiting = sum(self._slices[w].stop - self._slices[w].start for w in streaming)
            raise NoAsyncCallError(
                f"recv() returns batch_size={self.batch_size} envs, but only {waiting} are in flight: send() "
                "actions for more envs first.",
                "step",
            )
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._arrived) < needed:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            received = self._pool.receive("stepping", remaining)
            if received is None:
                raise WorkerTimeoutError(
                    f"recv() waited {timeout} s for {needed - len(self._arrived)} more workers' envs; workers "
                    f"{sorted(self._in_flight)} are still stepping. Their envs stay in flight: call recv() again."
                )
            w, msg = received
            if w in self._in_flight:
                self._arrived.append((w, self._in_flight.pop(w), msg))
        ready, self._arrived = self._arrived[:needed], self._arrived[needed:]
        if not self._streaming_workers():
            self._state = AsyncState.DEFAULT
        return self._first_ready_batch(ready)

    def _first_ready_batch(
        self, ready: list[tuple[int, str, Message]]
    ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any], np.ndarray]:
        env_ids = np.concatenate([np.arange(self._slices[w].start, self._slices[w].stop) for w, _, _ in ready])
        n = len(env_ids)
        rewards, terminations, truncations = np.zeros(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_)
        infos: dict[str, Any] = {}
        offset = 0
        for w, what, msg in ready:
            sl = self._slices[w]
            rows = slice(offset, offset + sl.stop - sl.start)
            self._write_slice(sl, msg, n_extra=3 if what == "step" else 0)
            if what == "step":
                rewards[rows], terminations[rows], truncations[rows] = msg.arrays[-3:]
            records = self._pool.loads(msg.blobs[0]) if msg.blobs[0] else []
            if what == "restarted":  # a replacement's fresh envs: the cut episodes end here
                truncations[rows] = True
                extra = dict(records)
                records = [(i, {**extra.get(i, {}), WORKER_RESTARTED_KEY: True}) for i in range(rows.stop - rows.start)]
            infos = replay_infos(infos, records, n, offset)
            offset = rows.stop
        if self._array_obs:
            obs = unflatten(self.single_observation_space, [leaf[env_ids] for leaf in self._obs_leaves])
        else:
            obs = concatenate(self.single_observation_space, [self._env_obs[i] for i in env_ids], self._batch_obs(n))
        return obs, rewards, terminations, truncations, infos, env_ids

    def _streaming_workers(self) -> list[int]:
        """Workers whose envs are in the first-ready API's hands: stepping, or replied and not yet recv()'d."""
        return [*self._in_flight, *(w for w, _, _ in self._arrived)]

    def _reset_replacement_in_flight(self, worker_id: int) -> None:
        """A restart hook: a replacement for a worker lost mid-``send`` is reset, and recv() reports the cut episodes."""
        if worker_id in self._in_flight:
            sl = self._slices[worker_id]
            self._pool.send(worker_id, Kind.RESET, {"seeds": [None] * (sl.stop - sl.start), "mask": None})
            self._in_flight[worker_id] = "restarted"

    def _check_first_ready(self) -> None:
        if self._observation_mode != "same":
            raise ValueError(
                "async_reset/send/recv batch any subset of envs, so they need observation_mode='same' "
                "(one observation space for all envs)."
            )

    def _action_space_for(self, n: int) -> Any:
        if n not in self._action_spaces:
            self._action_spaces[n] = batch_space(self.single_action_space, n)
        return self._action_spaces[n]

    def _batch_obs(self, n: int) -> Any:
        return create_empty_array(self.single_observation_space, n=n, fn=np.zeros)

    # -- attributes ------------------------------------------------------------------------
    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Ask every env for ``name`` (called with the arguments if it is callable)."""
        self._begin(AsyncState.WAITING_CALL)
        name = check_attribute_name(name)
        blob = pickle_argument((args, kwargs), f"arguments of call({name!r})")
        self._pool.send_each(Kind.CALL, {w: ({"name": name}, (), [blob]) for w in range(self.num_workers)})
        self._pending = list(range(self.num_workers))
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The per-env results of a ``call_async``, in env order."""
        self._end(AsyncState.WAITING_CALL, "call_wait")
        replies = self._pool.gather(self._pending, "calling", self.timeout if timeout is None else timeout)
        self._state = AsyncState.DEFAULT
        return tuple(value for w in range(self.num_workers) for value in self._pool.loads(replies[w].blobs[0]))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every env (or read it, if not callable); results in env order."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Read attribute ``name`` of every env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` on every env: one value each, or the same value for all."""
        name = check_attribute_name(name)
        values = per_env_values(values, self.num_envs)
        self._begin(AsyncState.WAITING_CALL)
        blobs = [pickle_argument(list(values[sl]), f"values of set_attr({name!r})") for sl in self._slices]
        self._pool.send_each(Kind.SET_ATTR, {w: ({"name": name}, (), [blob]) for w, blob in enumerate(blobs)})
        self._state = AsyncState.WAITING_CALL
        self._pool.gather(range(self.num_workers), "setting attributes", self.timeout)
        self._state = AsyncState.DEFAULT

    def render(self) -> tuple[Any, ...] | None:
        """The frames rendered by every env, in env order."""
        return self.call("render")

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """The seed of each env's random number generator."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """A copy of each env's random number generator (the originals stay in the workers)."""
        return self.get_attr("np_random")

    # -- shutdown --------------------------------------------------------------------------
    def close_extras(self, timeout: float | None = None, terminate: bool = False, **kwargs: Any) -> None:
        """Ask workers to close their envs and exit; kill those that do not within the grace period."""
        self._pool.close(_CLOSE_GRACE_S if timeout is None else timeout, terminate=terminate)

    def _close_after_error(self, terminate: bool) -> None:
        self.close(terminate=terminate)

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Per worker, what it said when it joined: ``{"worker_id", "host", "pid"}`` (replacements included)."""
        return self._pool.worker_info

    def __enter__(self) -> ClusterEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        """``ClusterEnv(CartPole-v1, num_envs=8, num_workers=2)``, with ``procs_per_worker`` when not 1."""
        name = "" if self.spec is None else f"{self.spec.id}, "
        procs = "" if self.procs_per_worker == 1 else f", procs_per_worker={self.procs_per_worker}"
        return f"{type(self).__name__}({name}num_envs={self.num_envs}, num_workers={self.num_workers}{procs})"
