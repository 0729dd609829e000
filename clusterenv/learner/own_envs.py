"""``LearnerEnvs``: the envs a ``ClusterEnv`` steps in the learner's own process (``learner_envs=k``).

A step of cheap envs costs less than waking a process, so the learner, which would wait
anyway, steps envs ``0..k-1`` itself between sending the workers their commands and reading
their replies. They are stepped as a worker steps its slice
(:class:`~clusterenv.stepping.recording_env.RecordingVectorEnv`: Gymnasium's own
``SyncVectorEnv`` code, infos recorded per env), and their results are read like a worker's
reply, so every autoreset mode, seed and info is exactly what ``SyncVectorEnv`` returns.

The trade-off: these envs have no process of their own. A crash in one (a segfault in a
simulator) is a crash of the learner; an exception follows ``on_env_error`` as in a worker;
recycling, usage reports and timeouts do not apply to them.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from clusterenv.stepping.failures import EnvTracker
from clusterenv.stepping.recording_env import RecordingVectorEnv, build_from, make_envs, reset_envs
from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.protocol import Kind, Message

__all__ = ["LearnerEnvs"]


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
        env_fns = [pickle.loads(blob) for blob in pickled_fns]
        tracker = EnvTracker()
        made = make_envs(env_fns, tracker)
        units = [i for i, env in enumerate(made) if isinstance(env, VectorEnv)]
        if units:
            for env in made:
                env.close()
            raise ValueError(
                f"`learner_envs` steps single envs in the learner, but entries {units} of `env_fns` make vector "
                "envs (units): give the learner single envs only, or use `learner_envs=0`."
            )
        self.envs: RecordingVectorEnv = build_from(
            env_fns, made, observation_mode, autoreset_mode, tracker, max_env_errors
        )
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
            self._pending_reply = call()

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
        obs = reset_envs(self.envs, seeds, options, mask)
        return self._reply(obs, [])

    def step(self, actions: Any) -> Message:
        """Step them with their ``actions`` (batched, as their vector env takes them): results in the batch, a reply."""
        obs, rewards, terminations, truncations, _ = self.envs.step(actions)
        fields = self._fields
        fields[0][...], fields[1][...], fields[2][...] = rewards, terminations, truncations
        if self._step_reply is not None and not self.envs.info_log:
            return self._step_reply
        return self._reply(obs, fields)

    def _reply(self, obs: Any, step_fields: list[np.ndarray]) -> Message:
        """What a worker would have replied, read by the batch as a worker's reply is."""
        log = self.envs.info_log
        infos: Any = []
        if log:
            self.envs.info_log = []
            infos = pack_infos(log, self.num_envs)
        blobs = [b""] if self._array_obs else [b"", pickle.dumps(self.envs.env_observations())]
        return Message(Kind.RESULT, {}, step_fields, blobs, infos)

    def call(self, indices: list[int] | None, name: str | None, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """``call``/``get_attr``/``apply`` on the envs ``indices`` (their own indices; ``None``: all)."""
        return self.envs.call_at(indices, name, args, kwargs)

    def set_attr(self, indices: list[int] | None, name: str, values: list[Any]) -> None:
        """``set_attr`` on the envs ``indices`` (their own indices; ``None``: all), one value each."""
        self.envs.set_attr_at(indices, name, values)

    def close(self) -> None:
        """Close the envs (and let go of the learner's batch, which may be the step region)."""
        self.envs.close()
        self.envs.observe_into(None)
        self._fields, self._step_reply = [], None
