"""``ClusterEnv``: a Gymnasium ``VectorEnv`` whose sub-environments live in worker processes."""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket as pysocket
import time
import weakref
from collections.abc import Callable, Sequence
from copy import deepcopy
from typing import Any

import numpy as np
import zmq
from gymnasium import Env
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array

from clusterenv import shared_obs
from clusterenv.batching import is_array_tree, leaf_arrays, leaf_specs
from clusterenv.errors import RemoteEnvError, WorkerLostError, WorkerStartError, WorkerTimeoutError
from clusterenv.launch import Launcher, resolve_launcher
from clusterenv.liveness import Heartbeat, HeartbeatMonitor, heartbeat_address
from clusterenv.protocol import Kind, Message
from clusterenv.recovery import replace_workers, report_interrupted
from clusterenv.transport import Channel, is_loopback, resolve_secret
from clusterenv.validation import (
    check_actions,
    check_env_fns,
    check_num_workers,
    check_reset_mask,
    check_seconds,
    check_seeds,
    pickle_argument,
    pickle_env_fn,
)

__all__ = ["ClusterEnv"]

logger = logging.getLogger(__name__)

# While waiting for replies, wake this often to notice a worker process that died.
_LIVENESS_POLL_S = 0.05
_CLOSE_GRACE_S = 5.0
# HELLOs kept while busy, for external replacement workers; the peers are authenticated, the bound is a safeguard.
_MAX_EARLY_HELLOS = 64
# Lets a CLOSE queued for a connected worker leave before the socket goes; peers that are gone hold nothing up.
_CLOSE_LINGER_MS = 500


def _default_num_workers(num_envs: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, num_envs))


class ClusterEnv(VectorEnv):
    """A vector env whose ``reset``/``step`` run in worker processes over ZeroMQ.

    The envs are split into contiguous slices, one per worker; each worker steps its
    slice as a ``SyncVectorEnv``, so results are bit-identical to
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
    ) -> None:
        """Start the workers and build the envs in them.

        Args:
            env_fns: zero-argument callables creating the environments, as for ``AsyncVectorEnv``.
            num_workers: worker processes; defaults to one per available core, at most ``len(env_fns)``.
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
            heartbeat: heartbeat constants; a worker silent for ``interval * liveness`` seconds is lost.
        """
        super().__init__()
        self._state = AsyncState.DEFAULT
        self.closed = True  # until the workers are up, close() has nothing to do
        check_env_fns(env_fns)
        self.num_envs = len(env_fns)
        if num_workers is None:
            num_workers = _default_num_workers(self.num_envs)
        self.num_workers = num_workers = check_num_workers(num_workers, self.num_envs)
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

        bounds = np.linspace(0, self.num_envs, num_workers + 1).round().astype(int)
        self._slices = [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

        key = resolve_secret(secret)
        if bind is not None and not is_loopback(bind) and key is None:
            raise ValueError(
                f"Refusing to bind {bind!r} without a shared secret: anyone who can reach it could "
                "send pickled code to workers. Pass `secret=` or set $CLUSTERENV_SECRET, or bind a "
                "loopback address."
            )
        self._launcher: Launcher = resolve_launcher(launcher)
        if bind is None and getattr(self._launcher, "requires_tcp", False):
            bind = "tcp://127.0.0.1:*"  # workers connect from other processes that Ray starts, on this host
        self._context = zmq.Context()
        self._channel = Channel.bind_router(self._context, bind, key or secrets.token_hex(32).encode())
        self.address = self._channel.endpoint
        try:
            self._monitor = HeartbeatMonitor(
                self._context, heartbeat_address(bind) if bind else None, self._channel.key, self.heartbeat
            )
        except BaseException:
            self._channel.close()
            self._context.term()
            raise
        self._seq = 0
        self._needs_reset = True
        self._identities: dict[int, bytes] = {}
        self._peers: dict[bytes, int] = {}
        self._workers_info: dict[int, dict[str, Any]] = {}
        self._last_sent: dict[int, tuple[Kind, dict[str, Any] | None, Sequence[np.ndarray], Sequence[bytes]]] = {}
        self._failed: set[int] = set()
        self._early_hellos: list[tuple[bytes | None, Message]] = []
        self._interrupted: dict[int, Message | None] = {}
        self._recovering = False
        self._pickled_fns, self._observation_mode, self._start_timeout = pickled_fns, observation_mode, start_timeout
        self._finalizer = weakref.finalize(self, _shutdown, self._launcher, self._monitor, self._channel, self._context)
        self.closed = False
        try:
            self._launcher.start(list(range(num_workers)), self.address, self._channel.key)
            self._join(list(range(num_workers)), start_timeout)
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

    # -- construction ----------------------------------------------------------------------
    def _join(self, worker_ids: list[int], timeout: float) -> None:
        """Wait for a HELLO for each id; a worker asking for no id (``clusterenv-worker`` by hand) gets a free one.

        Unauthenticated peers never get here (the channel drops them); authenticated ones
        asking for an id that is taken or not expected are told to CLOSE.
        """
        wanted = set(worker_ids)
        deadline = time.monotonic() + timeout
        while wanted:
            for w in sorted(wanted):
                code = self._launcher.exit_code(w)
                if code is not None:
                    raise WorkerStartError(
                        f"{self._launcher.describe(w)} exited with code {code} before joining {self.address}."
                    )
            if time.monotonic() > deadline:
                hint = getattr(self._launcher, "join_hint", None)
                raise WorkerStartError(
                    f"{len(worker_ids) - len(wanted)} of {len(worker_ids)} workers joined {self.address} within "
                    f"start_timeout={timeout} s; worker ids {sorted(wanted)} are missing."
                    + (f" {hint(self.address)}" if hint is not None else "")
                )
            received = self._early_hellos.pop(0) if self._early_hellos else None
            received = received or self._channel.recv(_LIVENESS_POLL_S, routed=True)
            if received is None:
                continue
            sender, msg = received
            if msg.kind is not Kind.HELLO or sender is None or sender in self._peers:
                logger.warning("Ignored %s from peer %r while waiting for workers to join.", msg.kind.name, sender)
                continue
            asked = msg.meta.get("worker_id")
            if asked in wanted or asked is None:
                worker_id = min(wanted) if asked is None else int(asked)
            else:
                logger.warning(
                    "Turned away a worker on %s (pid %s) asking for id %r: expected ids %s.",
                    msg.meta.get("host"),
                    msg.meta.get("pid"),
                    asked,
                    sorted(wanted),
                )
                try:
                    self._channel.send(Kind.CLOSE, {"seq": self._seq}, to=sender)
                except zmq.ZMQError:
                    pass
                continue
            wanted.discard(worker_id)
            self._identities[worker_id], self._peers[sender] = sender, worker_id
            self._workers_info[worker_id] = msg.meta

    def _init_meta(self, worker_id: int, *, replacement: bool = False) -> dict[str, Any]:
        """The INIT of one worker; also starts watching its heartbeats, which it starts on receipt."""
        self._monitor.watch(worker_id, self._identities[worker_id])
        return {
            "env_offset": self._slices[worker_id].start,
            "autoreset_mode": self.autoreset_mode.value,
            "observation_mode": self._observation_mode,
            "worker_id": worker_id,
            "heartbeat": self.heartbeat.to_meta(),
            "heartbeat_endpoint": self._monitor.endpoint,
            "autoreset_pending": replacement and self.autoreset_mode is AutoresetMode.NEXT_STEP,
        }

    def _init_workers(self, pickled_fns: list[bytes], observation_mode: str, timeout: float) -> None:
        for w, sl in enumerate(self._slices):
            self._send(w, Kind.INIT, self._init_meta(w), blobs=pickled_fns[sl])
        replies = self._gather(range(self.num_workers), "building envs", timeout)
        descriptions = [pickle.loads(replies[w].blobs[0]) for w in range(self.num_workers)]
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
        local = [w for w in range(self.num_workers) if self._workers_info[w].get("host") == host]
        if not local:
            return
        shared = shared_obs.SharedObservations(self.single_observation_space, self.num_envs)
        try:
            self._seq += 1
            for w in local:
                self._send(w, Kind.SHARE_OBS, shared.meta(self._slices[w].start, self._slices[w].stop))
            replies = self._gather(local, "mapping shared observations", timeout)
        finally:
            shared.unlink()
        self._observations = shared.observations
        attached = sorted(w for w, reply in replies.items() if reply.meta.get("attached"))
        logger.debug("Workers %s write observations into shared memory at %s.", attached, shared.path)

    # -- messaging -------------------------------------------------------------------------
    def _send(
        self,
        worker_id: int,
        kind: Kind,
        meta: dict[str, Any] | None = None,
        arrays: Sequence[np.ndarray] = (),
        blobs: Sequence[bytes] = (),
    ) -> None:
        self._last_sent[worker_id] = (kind, meta, arrays, blobs)  # replayed to a replacement worker
        try:
            self._channel.send(
                kind, {**(meta or {}), "seq": self._seq}, list(arrays), list(blobs), to=self._identities[worker_id]
            )
        except zmq.ZMQError as exc:
            if self.on_worker_failure == "restart" and not self._recovering:
                logger.warning("Worker %d is unreachable (%s); it will be replaced.", worker_id, exc)
                self._failed.add(worker_id)
                return
            raise self._lost(worker_id, f"sending {kind.name}") from exc

    def _lost(self, worker_id: int, doing: str) -> WorkerLostError:
        code = self._launcher.exit_code(worker_id)
        silence = self._monitor.silence(worker_id)
        if code is not None:
            how = f"exited with code {code}"
        elif silence is not None and silence > self.heartbeat.expiry:
            how = (
                f"stopped answering heartbeats ({silence:.1f} s silent; interval={self.heartbeat.interval} s, "
                f"liveness={self.heartbeat.liveness})"
            )
        else:
            how = "is unreachable"
        sl = self._slices[worker_id]
        error = WorkerLostError(
            f"{self._launcher.describe(worker_id)}, running envs {sl.start}..{sl.stop - 1}, {how} while {doing}."
        )
        self.close(terminate=True)
        return error

    def _check_alive(self, worker_ids: set[int] | range, doing: str) -> set[int]:
        """Workers among ``worker_ids`` that exited or expired: raised, or (restart) returned and marked failed."""
        expired = self._monitor.expired()
        lost = {w for w in worker_ids if w in expired or self._launcher.exit_code(w) is not None}
        if lost and (self.on_worker_failure == "raise" or self._recovering):
            raise self._lost(min(lost), doing)
        for w in sorted(lost):
            logger.warning("%s was lost while %s; replacing it.", self._launcher.describe(w), doing)
        self._failed |= lost
        return lost

    def _gather(
        self,
        worker_ids: Sequence[int] | range,
        doing: str,
        timeout: float | None,
        on_request: Callable[[int, Message], bool] | None = None,
    ) -> dict[int, Message]:
        """One reply per worker to the current ``seq``; raises on error, death or timeout.

        ``on_request(worker_id, msg)`` may answer a mid-call request (a weight pull during a
        rollout) and return True: that worker's final reply is then still to come.
        """
        pending = set(worker_ids) - self._failed
        replies: dict[int, Message] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            # Checked before every receive, not only when idle, so that stray messages cannot postpone it.
            if deadline is not None and time.monotonic() > deadline:
                error = WorkerTimeoutError(
                    f"Workers {sorted(pending)} did not reply within {timeout} s while {doing}. Their envs are "
                    "now in an unknown state, so the ClusterEnv was closed. Raise `timeout` if the "
                    "environments are this slow."
                )
                self.close(terminate=True)
                raise error
            received = self._channel.recv(_LIVENESS_POLL_S, routed=True)
            if received is None:
                pending -= self._check_alive(pending, doing)
                continue
            sender, msg = received
            worker_id = self._worker_of(sender)
            if worker_id is None and msg.kind is Kind.HELLO and len(self._early_hellos) < _MAX_EARLY_HELLOS:
                self._early_hellos.append(received)  # a replacement that joined before the loss was seen
                continue
            if worker_id is None or msg.meta.get("seq") != self._seq:
                continue  # a reply to a call that timed out earlier, or a stray peer
            if msg.kind is Kind.ERROR:
                raise self._remote_error(worker_id, msg, doing)
            if on_request is not None and worker_id in pending and on_request(worker_id, msg):
                continue
            if worker_id in pending:
                pending.discard(worker_id)
                replies[worker_id] = msg
        lost = self._failed.intersection(worker_ids)
        if lost:
            replace_workers(self, sorted(lost), replies, doing)
        return replies

    def _worker_of(self, sender: bytes | None) -> int | None:
        return None if sender is None else self._peers.get(sender)

    def _remote_error(self, worker_id: int, msg: Message, doing: str | None = None) -> RemoteEnvError:
        meta = msg.meta
        where = f"env {meta['env_index']}" if meta.get("env_index") is not None else "an env"
        during = "" if doing is None else f" while {doing}"
        error = RemoteEnvError(
            f"{where} on worker {worker_id} raised {meta['exc_type']}{during}: {meta['message']}\n\n"
            f"Remote traceback:\n{meta['traceback']}",
            env_index=meta.get("env_index"),
            worker_id=worker_id,
            exc_type=meta["exc_type"],
            remote_traceback=meta["traceback"],
        )
        if msg.blobs:
            try:
                error.__cause__ = pickle.loads(msg.blobs[0])
            except Exception:
                logger.debug("Could not unpickle the remote exception.", exc_info=True)
        self.close()
        return error

    def _begin(self, state: AsyncState) -> None:
        self._assert_is_running()
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{state.value}` while waiting for a pending call to `{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._seq += 1

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
        options = dict(options) if options is not None else None
        mask = None
        if options is not None and "reset_mask" in options:
            mask = check_reset_mask(options.pop("reset_mask"), self.num_envs)
        blobs = [] if options is None else [pickle_argument(options, "`options` of reset")]
        self._pending = []
        for w, sl in enumerate(self._slices):
            if mask is not None and not mask[sl].any():
                continue
            meta = {"seeds": seeds[sl], "mask": None if mask is None else mask[sl].tolist()}
            self._send(w, Kind.RESET, meta, blobs=blobs)
            self._pending.append(w)
        if mask is None:
            self._rewards[:] = 0.0
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the observations of a ``reset_async``; ``timeout`` defaults to the env's."""
        self._end(AsyncState.WAITING_RESET, "reset_wait")
        replies = self._gather(self._pending, "resetting", self.timeout if timeout is None else timeout)
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
        for w, sl in enumerate(self._slices):
            self._send(w, Kind.STEP, arrays=[leaf[sl] for leaf in leaves], blobs=())
        self._pending = list(range(self.num_workers))
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for the results of a ``step_async``; ``timeout`` defaults to the env's."""
        self._end(AsyncState.WAITING_STEP, "step_wait")
        replies = self._gather(self._pending, "stepping", self.timeout if timeout is None else timeout)
        self._state = AsyncState.DEFAULT
        infos = self._collect(replies, n_extra=3)
        if self._interrupted:
            infos = report_interrupted(self, infos)
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
            obs_arrays = msg.arrays[: len(msg.arrays) - n_extra]
            if obs_arrays:  # else the worker wrote its slice into the shared batch
                for leaf, part in zip(self._obs_leaves, obs_arrays, strict=True):
                    leaf[sl] = part
            if n_extra:
                rewards, terminations, truncations = msg.arrays[-3:]
                self._rewards[sl], self._terminations[sl], self._truncations[sl] = rewards, terminations, truncations
            if msg.blobs[0]:
                for local_index, env_info in pickle.loads(msg.blobs[0]):
                    infos = self._add_info(infos, env_info, sl.start + local_index)
            if not self._array_obs:
                self._env_obs[sl] = pickle.loads(msg.blobs[1])
        if not self._array_obs:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)  # type: ignore[arg-type]
        return infos

    def _observation_batch(self) -> Any:
        if not self.copy:
            return self._observations
        if type(self._observations) is np.ndarray and self._observations.dtype != object:
            return self._observations.copy()  # what deepcopy does for a numeric array, without its memo bookkeeping
        return deepcopy(self._observations)

    # -- attributes ------------------------------------------------------------------------
    def call_async(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Ask every env for ``name`` (called with the arguments if it is callable)."""
        self._begin(AsyncState.WAITING_CALL)
        blob = pickle_argument((args, kwargs), f"arguments of call({name!r})")
        for w in range(self.num_workers):
            self._send(w, Kind.CALL, {"name": name}, blobs=[blob])
        self._pending = list(range(self.num_workers))
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The per-env results of a ``call_async``, in env order."""
        self._end(AsyncState.WAITING_CALL, "call_wait")
        replies = self._gather(self._pending, "calling", self.timeout if timeout is None else timeout)
        self._state = AsyncState.DEFAULT
        return tuple(value for w in range(self.num_workers) for value in pickle.loads(replies[w].blobs[0]))

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on every env (or read it, if not callable); results in env order."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Read attribute ``name`` of every env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` on every env: one value each, or the same value for all."""
        if not isinstance(values, (list, tuple)):
            values = [values for _ in range(self.num_envs)]
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        self._begin(AsyncState.WAITING_CALL)
        for w, sl in enumerate(self._slices):
            blob = pickle_argument(list(values[sl]), f"values of set_attr({name!r})")
            self._send(w, Kind.SET_ATTR, {"name": name}, blobs=[blob])
        self._state = AsyncState.WAITING_CALL
        self._gather(range(self.num_workers), "setting attributes", self.timeout)
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
        grace = _CLOSE_GRACE_S if timeout is None else timeout
        # Also on terminate: workers this process cannot kill (external, remote) must hear it.
        # Without blocking: a frozen worker's full queue must not hang close().
        self._channel.socket.setsockopt(zmq.SNDTIMEO, 0)
        self._seq += 1
        for identity in self._identities.values():
            try:
                self._channel.send(Kind.CLOSE, {"seq": self._seq}, to=identity)
            except zmq.ZMQError:
                pass  # already gone
        if not terminate:
            self._await_closed(grace)
        self._launcher.stop(0.0 if terminate else grace)
        self._finalizer()

    def _await_closed(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for CLOSED from every worker not known to be gone."""
        pending = set(self._identities)
        deadline = time.monotonic() + grace
        while pending and time.monotonic() < deadline:
            received = self._channel.recv(_LIVENESS_POLL_S, routed=True)
            if received is not None:
                worker_id = self._worker_of(received[0])
                if received[1].kind is Kind.CLOSED and worker_id is not None:
                    pending.discard(worker_id)
                continue
            expired = self._monitor.expired()
            pending = {w for w in pending if w not in expired and self._launcher.exit_code(w) is None}

    @property
    def worker_info(self) -> list[dict[str, Any]]:
        """Per worker, what it said when it joined: ``{"worker_id", "host", "pid"}`` (replacements included)."""
        return [
            {"worker_id": w, "host": info.get("host"), "pid": info.get("pid")}
            for w, info in sorted(self._workers_info.items())
        ]

    def __enter__(self) -> ClusterEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        """``ClusterEnv(CartPole-v1, num_envs=8, num_workers=2)``."""
        name = "" if self.spec is None else f"{self.spec.id}, "
        return f"{type(self).__name__}({name}num_envs={self.num_envs}, num_workers={self.num_workers})"


def _shutdown(launcher: Launcher, monitor: HeartbeatMonitor, channel: Channel, context: zmq.Context) -> None:
    """Last-resort cleanup, also run at interpreter exit for envs never closed."""
    launcher.stop(0.0)
    monitor.close()
    channel.close(linger=_CLOSE_LINGER_MS)
    context.term()
