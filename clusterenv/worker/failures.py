"""An exception raised by env code, captured once and carried to the learner.

A worker's envs run in the worker itself or in its env processes; either way an env that
raises becomes one :class:`EnvFailure`: which env raised (found by :class:`EnvTracker`),
the exception's type name, message and formatted traceback, and the exception pickled
when it can be. The learner turns it into a ``RemoteEnvError`` of the original type.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle
from gymnasium.vector.utils import concatenate

from clusterenv.wire.protocol import Kind, Message
from clusterenv.worker.step_clock import StepClock

__all__ = ["EnvFailure", "EnvTracker", "TrackedEnvs", "error_reply"]


class EnvTracker:
    """Which env the worker's code reached last, so that the env that raises is known by its index.

    ``SyncVectorEnv``'s loops reach each env by indexing or iterating its ``envs`` list just
    before calling it; :class:`~clusterenv.worker.recording_env.RecordingVectorEnv` keeps that
    list as a :class:`TrackedEnvs` that writes the index here, as do the loops that build the envs.
    """

    def __init__(self) -> None:
        self.reached: int | None = None
        #: Times each env step while a batch step runs (:mod:`clusterenv.worker.step_clock`).
        self.clock = StepClock()

    def forget(self) -> None:
        """Start a new command: no env reached yet."""
        self.reached = None


class TrackedEnvs(list[Any]):
    """A list of envs that tells its :class:`EnvTracker` the index of each env it hands out."""

    def __init__(self, envs: list[Any], tracker: EnvTracker) -> None:
        super().__init__(envs)
        self.tracker = tracker

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            self.tracker.reached = index if index >= 0 else len(self) + index
            if self.tracker.clock.running:
                self.tracker.clock.reached()
        return super().__getitem__(index)

    def __iter__(self) -> Any:
        for i, env in enumerate(super().__iter__()):
            self.tracker.reached = i
            yield env


@dataclass(frozen=True)
class EnvFailure:
    """What the learner is told of an exception raised by env code.

    Attributes:
        env_index: the env's index among the envs it was built with (``None``: not known).
        exc_type: the name of the exception's type.
        message: ``str()`` of the exception.
        traceback: the traceback, formatted where it was raised.
        cause: the cloudpickled exception, when it pickles.
    """

    env_index: int | None
    exc_type: str
    message: str
    traceback: str
    cause: bytes | None = None

    @classmethod
    def capture(cls, exc: BaseException, tracker: EnvTracker, misfit: Any = None) -> EnvFailure:
        """The failure for ``exc``, just caught; ``misfit()`` names the env whose observation does not batch.

        ``SyncVectorEnv`` batches the observations after its loop, so an observation that does
        not fit the space raises in ``concatenate`` once every env was reached: the env is then
        the one whose observation does not fit, not the last one reached.
        """
        index = tracker.reached
        if misfit is not None and _passed_through_concatenate(exc):
            found = misfit()
            index = index if found is None else found
        try:
            cause: bytes | None = cloudpickle.dumps(exc)
        except Exception:
            cause = None
        return cls(index, type(exc).__name__, str(exc), traceback.format_exc(), cause)

    def shifted(self, offset: int) -> EnvFailure:
        """The same failure with its env index counted ``offset`` envs further (a part within a slice)."""
        return self if self.env_index is None else replace(self, env_index=self.env_index + offset)


def _passed_through_concatenate(exc: BaseException) -> bool:
    return any(
        frame.f_globals.get("__name__") == concatenate.__module__ for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def error_reply(failure: EnvFailure) -> Message:
    """The ERROR message that carries ``failure`` to the learner."""
    meta = {
        "env_index": failure.env_index,
        "exc_type": failure.exc_type,
        "message": failure.message,
        "traceback": failure.traceback,
    }
    return Message(Kind.ERROR, meta, [], [] if failure.cause is None else [failure.cause])
