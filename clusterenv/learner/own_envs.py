"""``LearnerEnvs``: the envs a ``ClusterEnv`` steps in the learner's own process (``learner_envs=k``).

A step of cheap envs costs less than waking a process, so the learner, which would wait
anyway, steps envs ``0..k-1`` itself between sending the workers their commands and reading
their replies. They are stepped as a worker steps its slice
(:class:`~clusterenv.stepping.recording_env.RecordingVectorEnv`: Gymnasium's own
``SyncVectorEnv`` code, infos recorded per env), and their results are read like a worker's
reply, so every autoreset mode, seed and info is exactly what ``SyncVectorEnv`` returns.

Everything else a worker's envs do, these do too (:class:`~clusterenv.learner.worker_like.WorkerLike`):
an exception of theirs follows ``on_env_error`` and is raised as the same ``RemoteEnvError``,
their warnings are filtered as in a worker process (shown, never raised into the training
loop), and what ``call``, ``get_attr`` and ``apply`` return, and what they and ``set_attr``
are given, goes through the same pickling round trip, so that it is a copy.

The trade-off: these envs have no process of their own. A crash in one (a segfault in a
simulator, ``os._exit``) is a crash of the learner, as with ``SyncVectorEnv``; recycling,
usage reports and timeouts do not apply to them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from clusterenv.learner.worker_like import WorkerLike
from clusterenv.stepping.failures import EnvTracker
from clusterenv.stepping.recording_env import RecordingVectorEnv, build_from, make_envs, reset_envs
from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.protocol import Kind, Message

__all__ = ["LearnerEnvs", "UnitsInLearnerShare"]


class UnitsInLearnerShare(ValueError):
    """An entry of the learner's share makes a vector env (a unit): the learner steps single envs only."""


class LearnerEnvs:
    """Envs ``0..k-1`` of a ``ClusterEnv``, stepped by the learner itself.

    Args:
        pickled_fns: their factories, pickled as the workers get theirs.
        observation_mode: ``"same"``, ``"different"``, or the single observation space every
            env's observation batches into.
        autoreset_mode: Gymnasium's autoreset mode.
        max_env_errors: under ``on_env_error="reset"``, the errors one env may raise within
            1,000 of its steps (``None``: errors raise).
    """

    def __init__(
        self,
        pickled_fns: Sequence[bytes],
        observation_mode: Any,
        autoreset_mode: AutoresetMode,
        max_env_errors: int | None,
    ) -> None:
        #: The envs' global indices.
        self.slice = slice(0, len(pickled_fns))
        tracker = EnvTracker()
        # Their code runs as a worker's: its warnings filtered as there, its errors raised as a worker's.
        self._env_code = WorkerLike(tracker)
        with self._env_code.doing("building envs"):
            env_fns = [pickle.loads(blob) for blob in pickled_fns]
            made = make_envs(env_fns, tracker)
        units = [i for i, env in enumerate(made) if isinstance(env, VectorEnv)]
        if units:
            for env in made:
                env.close()
            raise UnitsInLearnerShare(
                f"`learner_envs` steps single envs in the learner, but entries {units} of `env_fns` make vector "
                "envs (units): give the learner single envs only, or use `learner_envs=0`."
            )
        with self._env_code.doing("building envs"):
            self.envs: RecordingVectorEnv = build_from(
                env_fns, made, observation_mode, autoreset_mode, tracker, max_env_errors
            )
        self._env_code.misfit = self.envs.misfit_observation
        self._array_obs = is_array_tree(self.envs.single_observation_space)
        self.envs.samples_steps = False  # nothing reports their step times (no usage reports, no recycling)
        self._fields: list[np.ndarray] = []  # their rows of the batch's step fields (write_into)
        self._step_reply: Message | None = None  # the reply of every step without infos (array observations)
        self._pending_reply: Message | None = None
        self._call: Callable[[], Message] | None = None  # their part of the call in progress, not started yet
        #: Whether a reset or step of theirs is part of the call in progress (its reply to be collected).
        self.due = False

    @property
    def num_envs(self) -> int:
        """How many envs the learner steps."""
        return self.envs.num_envs

    def description(self) -> dict[str, Any]:
        """What a worker reports of its envs (spaces, metadata), for the batch's spaces."""
        return self.envs.description()

    def write_into(self, batch: Any, step_fields: Sequence[np.ndarray]) -> None:
        """Write their results into their rows of the learner's batch: observations, rewards, terminations, truncations.

        Observations without a fixed array form travel as lists. A step's reply then names
        the rows (as a worker's on the shared step path does), and the batch copies nothing.
        """
        self._fields = [field[self.slice] for field in step_fields]
        if self._array_obs:
            space = self.envs.single_observation_space
            self.envs.observe_into(unflatten(space, [leaf[self.slice] for leaf in leaf_arrays(space, batch)]))
            self._step_reply = Message(Kind.RESULT, {}, self._fields, [b""], [])

    def expect(self, call: Callable[[], Message]) -> None:
        """Their part of the call about to be sent: ``call`` (a reset or step), recorded before anything leaves.

        An interrupt between the workers' commands and :meth:`run` then leaves it to run when
        the call is finished (``reset_wait``/``step_wait``), so that they step with the others.
        """
        self._call, self._pending_reply, self.due = call, None, True

    def forget(self) -> None:
        """No part in the call in progress."""
        self._call, self._pending_reply, self.due = None, None, False

    def run(self) -> None:
        """Run their part of the call in progress if it has not started; the reply waits for :meth:`take_reply`."""
        call, self._call = self._call, None
        if call is not None:
            try:
                self._pending_reply = call()
            except BaseException:
                self.envs.info_log = []  # cut short (Ctrl-C, an error): the infos it recorded are nobody's
                raise

    def take_reply(self) -> Message:
        """Their reply to the call in progress, collected once.

        Raises:
            RuntimeError: the reset or step was interrupted (Ctrl-C): their state is unknown.
        """
        reply, self._pending_reply, self.due = self._pending_reply, None, False
        if reply is None:
            raise RuntimeError(
                "The envs the learner steps itself (`learner_envs`) were interrupted in the middle of a "
                "reset or step: their state is unknown. Call reset() before stepping again."
            )
        return reply

    def reset(self, seeds: list[int | None] | None, options: Any, mask: list[bool] | None) -> Message:
        """Reset them (those in ``mask``, if any): a reply as a worker's, its observations in the batch already."""
        with self._env_code.doing("resetting"):
            obs = reset_envs(self.envs, seeds, options, mask)
        return self._reply(obs, [])

    def step(self, actions: Any) -> Message:
        """Step them with their ``actions`` (batched, as their vector env takes them): results in the batch, a reply."""
        fields = self._fields
        with self._env_code.doing("stepping"):
            obs = self.envs.step_into(actions, *fields)
        if self._step_reply is not None and not self.envs.info_log:
            return self._step_reply
        return self._reply(obs, fields)

    def took(self, reply: Message) -> bool:
        """Whether ``reply`` (theirs) is the kept reply of a step without infos: all in the batch already."""
        return reply is self._step_reply

    def _reply(self, obs: Any, step_fields: list[np.ndarray]) -> Message:
        """What a worker would have replied, read by the batch as a worker's reply is."""
        log = self.envs.info_log
        infos: Any = []
        if log:
            self.envs.info_log = []
            infos = pack_infos(log, self.num_envs)
        blobs = [b""] if self._array_obs else [b"", pickle.dumps(self.envs.env_observations())]
        return Message(Kind.RESULT, {}, step_fields, blobs, infos)

    def call(self, indices: list[int] | None, name: str | None, arguments: bytes) -> list[Any]:
        """``call``/``get_attr``/``apply`` on the envs ``indices`` (their own indices; ``None``: all).

        As a worker answers it: ``arguments`` is the pickled ``(args, kwargs)`` sent to the workers,
        and the results are pickled and unpickled, so that neither side holds the other's objects.
        """
        with self._env_code.doing("calling"):
            args, kwargs = pickle.loads(arguments)
            return pickle.loads(cloudpickle.dumps(self.envs.call_at(indices, name, args, kwargs)))

    def set_attr(self, indices: list[int] | None, name: str, values: bytes) -> None:
        """``set_attr`` on the envs ``indices`` (their own indices; ``None``: all), one of the pickled ``values`` each.

        Pickled as the workers' values are: the envs hold copies of the caller's objects.
        """
        with self._env_code.doing("setting attributes"):
            self.envs.set_attr_at(indices, name, list(pickle.loads(values)))

    def close(self) -> None:
        """Close the envs (and let go of the learner's batch, which may be the step region)."""
        with self._env_code.doing("closing envs"):
            self.envs.close()
        self.envs.observe_into(None)
        self._fields, self._step_reply = [], None
