"""A worker's slice stepped by several child processes (``procs_per_worker > 1``).

Worker side. With ``ClusterEnv(..., procs_per_worker=N)`` (or ``clusterenv-worker --procs N``)
a worker splits its slice into ``min(N, slice size)`` contiguous parts and starts one child
process per part (``python -m clusterenv.worker.env_process``). Each child steps its part with a
:class:`~clusterenv.stepping.recording_env.RecordingVectorEnv`, exactly as a worker steps its whole
slice with ``procs_per_worker=1``, so results stay bit-identical to one ``SyncVectorEnv``.
A 64-core host is then one ZeroMQ peer of the learner: the learner's cost grows with
hosts, not with processes.

Per command the worker sends every child its part (actions, seeds, reset mask, values)
before reading any reply, so the children work in parallel. Between a worker and its
children runs a socketpair that only those two processes hold (so no authentication),
carrying pickles:

* observations of array spaces never travel on it: children write them into memory
  shared with the worker (``shared_obs``: the worker's own mapping, or the learner's
  batch once the learner shares it);
* per-env info records come back with part-local indices and are re-indexed in env
  order, so the learner replays exactly the records one process would have made.

Failures:

* an env that raises: its child replies with the env's index and the traceback; the
  worker reads every other reply first (so that each socket stays in step), then raises
  :class:`ChildEnvError`, which it sends on as the usual ``ERROR`` (a ``RemoteEnvError``
  on the learner);
* a child process that dies: the worker cannot go on without its envs. It exits with
  :data:`ENV_PROCESS_LOST_EXIT_CODE`, so the learner treats it as any lost worker
  (``WorkerLostError``, or a replacement under ``on_worker_failure="restart"``);
* the worker dying: the kernel kills its children (``PR_SET_PDEATHSIG``, Linux), and
  anywhere a child exits once its socket reports end-of-file (``clusterenv.worker.env_process``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Mapping
from multiprocessing import Pipe
from typing import Any

import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_differing_spaces, batch_space, concatenate, create_empty_array, iterate

from clusterenv.stepping.failures import EnvFailure
from clusterenv.stepping.recording_env import dumps
from clusterenv.stepping.step_clock import StepClock
from clusterenv.wire import shared_memory
from clusterenv.wire.contract import (
    by_part,
    check_spaces,
    in_index_order,
    per_env_seeds,
    per_env_values,
    split_evenly,
    values_by_part,
)
from clusterenv.wire.infos import InfoRecord
from clusterenv.wire.leaves import is_array_tree, leaf_arrays
from clusterenv.wire.processes import child_environment

__all__ = ["ENV_PROCESS_LOST_EXIT_CODE", "ChildEnvError", "EnvProcessLost", "ProcVectorEnv"]

logger = logging.getLogger(__name__)

#: The exit status of a worker whose env process died.
ENV_PROCESS_LOST_EXIT_CODE = 4
# How long close() lets the children close their envs before killing them; the learner
# gives the whole worker 5 s (its close grace) before killing it, and with it the children.
_CLOSE_GRACE_S = 3.0
# How long to wait for a child whose socket closed to report its exit status.
_EXIT_STATUS_WAIT_S = 1.0


class EnvProcessLost(Exception):
    """One of the worker's env processes died: the worker cannot go on without its envs."""


class ChildEnvError(Exception):
    """An env raised inside one of the worker's env processes: ``failure`` says which (within the slice) and how."""

    def __init__(self, failure: EnvFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


class _Child:
    """One env process: its part of the slice, its process and its end of the socketpair."""

    def __init__(self, index: int, part: slice, env_offset: int) -> None:
        self.index, self.part, self.env_offset = index, part, env_offset
        ours, theirs = Pipe()
        env = child_environment(secret=None)  # the secret is the worker's business: a child never talks to the learner
        fd = theirs.fileno()
        command = [
            sys.executable,
            "-m",
            "clusterenv.worker.env_process",
            "--fd",
            str(fd),
            "--parent-pid",
            str(os.getpid()),
        ]
        self.process = subprocess.Popen(command, env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        theirs.close()  # else the worker would keep the child's end open, and never see it close
        self.conn = ours

    def send(self, command: str, payload: Any) -> None:
        try:
            self.conn.send_bytes(dumps((command, payload)))
        except OSError:
            raise EnvProcessLost(self._lost()) from None

    def recv(self) -> tuple[str, Any]:
        try:
            reply: tuple[str, Any] = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise EnvProcessLost(self._lost()) from None
        return reply

    def _lost(self) -> str:
        try:
            code: int | None = self.process.wait(_EXIT_STATUS_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        how = "closed its socket" if code is None else f"exited with code {code}"
        first, last = self.env_offset + self.part.start, self.env_offset + self.part.stop - 1
        return f"env process {self.index} (pid {self.process.pid}, envs {first}..{last}) {how}"

    def end(self, deadline: float | None) -> None:
        """Wait until ``deadline`` (``None``: not at all) for the process to exit, then kill it; close the socket."""
        if deadline is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(max(0.0, deadline - time.monotonic()))
        if self.process.poll() is None:
            if deadline is not None:
                logger.warning("Env process %d (pid %d) did not exit; killing it.", self.index, self.process.pid)
            self.process.kill()
            self.process.wait()
        self.conn.close()


class ProcVectorEnv(VectorEnv):
    """A worker's slice of envs, stepped by ``min(num_procs, len(env_blobs))`` child processes.

    The same accessors as :class:`~clusterenv.stepping.recording_env.RecordingVectorEnv` (``info_log``,
    ``current_observations``, ``autoresetting``...), so the worker and its local-policy
    handlers use either one.

    Args:
        env_blobs: the pickled env factories of the slice.
        num_procs: how many child processes at most.
        observation_mode: ``"same"``, ``"different"``, or the single observation space (see ``recording.build``).
        autoreset_mode: Gymnasium's autoreset mode.
        env_offset: the global index of the slice's first env, for messages.
        registry: the learner's env registry (pickled specs by id), installed in every child before its factories run.
        max_env_errors: under ``on_env_error="reset"``, the errors each env may raise (see ``stepping/env_errors.py``).
    """

    info_log: list[InfoRecord]

    def __init__(
        self,
        env_blobs: list[bytes],
        num_procs: int,
        *,
        observation_mode: str | Space,
        autoreset_mode: Any,
        env_offset: int = 0,
        registry: dict[str, bytes] | None = None,
        max_env_errors: int | None = None,
    ) -> None:
        super().__init__()
        self.num_envs = len(env_blobs)
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.info_log = []
        #: The env step times its env processes measured, handed over with their replies.
        self.step_clock = StepClock()
        self._children: list[_Child] = []
        try:
            for k, part in enumerate(split_evenly(self.num_envs, min(num_procs, self.num_envs))):
                self._children.append(_Child(k, part, env_offset))
            parts = self._all(
                lambda c: (
                    "init",
                    (env_blobs[c.part], observation_mode, self.autoreset_mode.value, registry or {}, max_env_errors),
                )
            )
            self._describe([parts[k] for k in range(len(self._children))], observation_mode)
            self._allocate()
        except BaseException:
            self.terminate()
            raise

    # -- construction ----------------------------------------------------------------------
    def _describe(self, parts: list[dict[str, Any]], observation_mode: str | Space) -> None:
        self._description = {
            "observation_spaces": [space for part in parts for space in part["observation_spaces"]],
            "action_spaces": [space for part in parts for space in part["action_spaces"]],
            "metadata": parts[0]["metadata"],
            "render_mode": parts[0]["render_mode"],
            "enforces_order": [flag for part in parts for flag in part["enforces_order"]],
        }
        self.metadata = dict(parts[0]["metadata"], autoreset_mode=self.autoreset_mode)
        self.render_mode = parts[0]["render_mode"]
        self.single_action_space = self._description["action_spaces"][0]
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        if isinstance(observation_mode, Space):  # each child checked its envs against it
            self.single_observation_space = observation_mode
            self.observation_space = batch_space(observation_mode, self.num_envs)
            return
        # Each child checked its own part, as SyncVectorEnv does; across parts is checked here,
        # before any child maps a batch laid out for another space.
        check_spaces(self._description["observation_spaces"], self._description["action_spaces"], observation_mode)
        self.single_observation_space = self._description["observation_spaces"][0]
        if observation_mode == "same":
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        else:
            self.observation_space = batch_differing_spaces(self._description["observation_spaces"])

    def _allocate(self) -> None:
        """The batch buffers; array observations live in a mapping shared with every child."""
        n, space = self.num_envs, self.single_observation_space
        self._rewards = np.zeros((n,), dtype=np.float64)
        self._terminations = np.zeros((n,), dtype=np.bool_)
        self._truncations = np.zeros((n,), dtype=np.bool_)
        self._autoreset = np.zeros((n,), dtype=np.bool_)
        self._env_obs: list[Any] = [None] * n
        self._array_obs = is_array_tree(space)
        if not self._array_obs:
            self._observations: Any = create_empty_array(space, n=n, fn=np.zeros)
            return
        private = shared_memory.SharedObservations(space, n)
        try:
            self._map_children(private.meta(0, n))
        finally:
            private.unlink()  # every child has mapped it (or failed to): the name is no longer needed
        self._observations = private.observations

    def _map_children(self, meta: Mapping[str, Any]) -> None:
        """Have every child write its part of the batch that ``meta`` describes (``shared_obs``).

        Only ever asked for a batch that this process has mapped: a child on the same host
        failing to map it is an error, not a reason to fall back to frames.
        """
        start = int(meta["start"])
        mapped = self._all(lambda c: ("share", dict(meta, start=start + c.part.start, stop=start + c.part.stop)))
        missing = sorted(k for k, ok in mapped.items() if not ok)
        if missing:
            raise RuntimeError(f"Env processes {missing} could not map the shared observations at {meta['path']}.")

    # -- talking to the children -----------------------------------------------------------
    def _request(self, commands: dict[int, tuple[str, Any]]) -> dict[int, Any]:
        """Send each child in ``commands`` its command, then read every reply, in child order.

        Raises the first child's error only after all replies are read, so that no reply is
        left behind to be taken for the answer to a later command.
        """
        for k, (command, payload) in commands.items():
            self._children[k].send(command, payload)
        replies, error = {}, None
        for k in commands:
            status, value = self._children[k].recv()
            if status == "ok":
                replies[k] = value
            elif error is None:
                error = ChildEnvError(value.shifted(self._children[k].part.start))
        if error is not None:
            raise error
        return replies

    def _all(self, command: Any) -> dict[int, Any]:
        return self._request({c.index: command(c) for c in self._children})

    def _absorb(self, replies: dict[int, Any]) -> None:
        """Write each child's step or reset results into the batch buffers, in env order."""
        for k, (arrays, autoreset, records, env_obs, step_times) in sorted(replies.items()):
            part = self._children[k].part
            self.step_clock.samples.extend(step_times)
            if arrays is not None:
                self._rewards[part], self._terminations[part], self._truncations[part] = arrays
            self._autoreset[part] = autoreset
            self.info_log.extend((part.start + i, info) for i, info in records)
            if not self._array_obs:
                self._env_obs[part] = env_obs
        if not self._array_obs:
            self._observations = concatenate(self.single_observation_space, self._env_obs, self._observations)

    # -- the VectorEnv API -----------------------------------------------------------------
    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the envs (those in ``options["reset_mask"]``, if given), as ``SyncVectorEnv.reset``.

        Their infos go to ``info_log``.
        """
        seeds = per_env_seeds(seed, self.num_envs)
        options = None if options is None else dict(options)
        mask = None if options is None or "reset_mask" not in options else np.asarray(options.pop("reset_mask"))
        commands = {}
        for c in self._children:
            if mask is not None and not np.any(mask[c.part]):
                continue  # SyncVectorEnv refuses an all-False mask; the learner also skips such workers
            part_options = options if mask is None else {**(options or {}), "reset_mask": mask[c.part]}
            commands[c.index] = ("reset", (seeds[c.part], part_options))
        self._absorb(self._request(commands))
        return self._observations, {}

    def reset_each(
        self, seeds: list[int | None], options: list[dict[str, Any] | None], mask: Any = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset env ``i`` with ``seeds[i]`` and ``options[i]`` (those in ``mask``), as ``reset_each`` does."""
        mask = None if mask is None else np.asarray(mask, dtype=np.bool_)
        commands = {
            c.index: ("reset_each", (seeds[c.part], options[c.part], None if mask is None else mask[c.part]))
            for c in self._children
            if mask is None or np.any(mask[c.part])
        }
        self._absorb(self._request(commands))
        return self._observations, {}

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env; infos go to ``info_log``, the returned observations are the batch buffer itself."""
        if is_array_tree(self.single_action_space):
            leaves = leaf_arrays(self.single_action_space, actions)
            self._absorb(self._all(lambda c: ("step", [leaf[c.part] for leaf in leaves])))
        else:
            items = list(iterate(self.action_space, actions))
            self._absorb(self._all(lambda c: ("step_items", items[c.part])))
        return self._observations, self._rewards.copy(), self._terminations.copy(), self._truncations.copy(), {}

    def call_at(self, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """``RecordingVectorEnv.call_at`` over the children: results in the order of ``indices``."""
        parts = [c.part for c in self._children]
        replies = self._request(
            {k: ("call", (local, name, args, kwargs)) for k, local in by_part(indices, parts).items()}
        )
        return in_index_order(indices, parts, replies)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call (or read) attribute ``name`` of every env, in env order."""
        return tuple(self.call_at(None, name, args, kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Read attribute ``name`` of every env."""
        return self.call(name)

    def set_attr_at(self, indices: list[int] | None, name: str, values: list[Any]) -> None:
        """Set attribute ``name`` on the envs ``indices`` (``None``: all), one value each."""
        routed = values_by_part(indices, [c.part for c in self._children], values)
        self._request({k: ("set_attr", (local, name, mine)) for k, (local, mine) in routed.items()})

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` on every env: one value each, or the same value for all."""
        self.set_attr_at(None, name, list(per_env_values(values, self.num_envs)))

    # -- what RecordingVectorEnv also offers -----------------------------------------------
    @property
    def current_observations(self) -> Any:
        """The batch of current observations (the buffer ``step`` writes into)."""
        return self._observations

    def env_observations(self) -> list[Any]:
        """The current per-env observations, for spaces without a fixed array form."""
        return self._env_obs

    def autoresetting(self) -> np.ndarray:
        """Under NEXT_STEP, which envs' next step is an autoreset step (a copy)."""
        return self._autoreset.copy()

    def mark_autoreset_pending(self) -> None:
        """Make every env's next step an autoreset step, as after a truncation (a replacement's envs)."""
        self._all(lambda c: ("mark_autoreset_pending", None))
        self._autoreset[:] = True

    def share_observations(self, meta: Mapping[str, Any]) -> bool:
        """Have the children write observations into the learner's shared batch (``shared_obs``), if it maps here."""
        view = shared_memory.attach(meta, self.single_observation_space)
        if view is None:
            return False
        self._map_children(meta)  # each copies its current observations there first
        self._observations = view
        return True

    def description(self) -> dict[str, Any]:
        """What the learner needs to know of these envs: per-env spaces, metadata and render mode."""
        return self._description

    # -- shutdown --------------------------------------------------------------------------
    def close_extras(self, **kwargs: Any) -> None:
        """Let the children close their envs and exit; kill those that do not within a grace period."""
        for c in self._children:
            with contextlib.suppress(EnvProcessLost):
                c.send("close", None)
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for c in self._children:
            c.end(deadline)
        self._children = []

    def terminate(self) -> None:
        """Kill the children now, without closing their envs (the learner is gone, or building failed)."""
        for c in self._children:
            c.end(None)
        self._children = []
        self.closed = True
