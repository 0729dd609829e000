"""An exception raised by env code, captured once and carried to the learner.

A worker's envs run in the worker itself or in its env processes; either way an env that
raises becomes one :class:`EnvFailure`: which env raised (found by :class:`EnvTracker`),
the exception's type name, message and formatted traceback, and the exception pickled
when it can be. The learner turns it into a ``RemoteEnvError`` of the original type.

Capturing never fails and never exceeds the wire's limits, whatever the exception: its
text is cut to :data:`MAX_MESSAGE_BYTES` and :data:`MAX_TRACEBACK_BYTES` (head and tail
kept, the cut marked), a ``__str__`` that raises falls back to ``repr()`` and then to the
type's name, and an exception that does not pickle, or pickles to more than
:data:`MAX_PICKLED_BYTES`, travels as its type's name and its text only.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import cloudpickle
from gymnasium.vector import SyncVectorEnv
from gymnasium.vector.utils import concatenate

from clusterenv.stepping.lean_loop import lean_step
from clusterenv.stepping.step_clock import StepClock
from clusterenv.wire.protocol import Kind, Message

__all__ = [
    "MAX_MESSAGE_BYTES",
    "MAX_PICKLED_BYTES",
    "MAX_TRACEBACK_BYTES",
    "EnvFailure",
    "EnvTracker",
    "TimedEnvs",
    "TrackedEnvs",
    "describe_exception",
    "error_reply",
    "index_in_step",
]

#: The most UTF-8 bytes of an env error's message that reach the learner (head and tail kept).
MAX_MESSAGE_BYTES = 8 * 1024
#: The most UTF-8 bytes of its formatted traceback (head and tail kept): with the message, well
#: within the wire's 64 KiB header.
MAX_TRACEBACK_BYTES = 32 * 1024
#: The most bytes of the pickled exception; a larger one travels as its type's name and text.
MAX_PICKLED_BYTES = 16 * 1024 * 1024
# The most UTF-8 bytes of an exception type's name.
_MAX_TYPE_NAME_BYTES = 256


class EnvTracker:
    """Which env the worker's code reached last, so that the env that raises is known by its index.

    ``SyncVectorEnv``'s loops (reset, call, set_attr, render, close) reach their envs by
    iterating its ``envs`` list, just before calling each;
    :class:`~clusterenv.stepping.recording_env.RecordingVectorEnv` keeps that list as a
    :class:`TrackedEnvs` that writes the index here, as do the loops that build the envs. A
    step that raises writes the index its loop reached (:func:`index_in_step`).
    """

    def __init__(self) -> None:
        self.reached: int | None = None
        #: Times each env step while a batch step runs (:mod:`clusterenv.stepping.step_clock`).
        self.clock = StepClock()

    def forget(self) -> None:
        """Start a new command: no env reached yet."""
        self.reached = None


class TrackedEnvs(list[Any]):
    """A list of envs that tells its :class:`EnvTracker` the index of each env its iteration hands out.

    Serves every loop but the batch step's (reset, call, set_attr, render, close): a step, the
    hot loop, is handed a plain list instead, and the env that raised is read from the
    exception's traceback (:func:`index_in_step`), which costs nothing until something raises.
    """

    def __init__(self, envs: list[Any], tracker: EnvTracker) -> None:
        super().__init__(envs)
        self.tracker = tracker

    def __iter__(self) -> Any:
        tracker = self.tracker
        for i, env in enumerate(super().__iter__()):
            tracker.reached = i
            yield env


class TimedEnvs(list[Any]):
    """The envs handed to a batch step that is timed: each env indexed ends the previous one's step.

    ``SyncVectorEnv.step`` indexes an env just before each call to it, so an autoreset inside a
    step (``SAME_STEP``) is timed as a step of its own.
    """

    def __init__(self, envs: list[Any], clock: StepClock) -> None:
        super().__init__(envs)
        self.clock = clock

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            self.clock.reached()
        return super().__getitem__(index)


# The loops whose variable ``i`` is the env being stepped: Gymnasium's, and the lean one that stands in for it.
_STEP_LOOPS = (SyncVectorEnv.step.__code__, lean_step.__code__)


def index_in_step(tb: TracebackType | None) -> int | None:
    """The env a step's loop had reached where the traceback ``tb`` passed through it.

    The loop is ``SyncVectorEnv.step``'s or the lean one (:mod:`~clusterenv.stepping.lean_loop`): its
    loop variable ``i``, read from the outermost such frame below ``tb``
    (an env's own vector env further in is not ours); ``None`` if the step raised before its loop.
    """
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code in _STEP_LOOPS:
            index = frame.f_locals.get("i")
            return index if isinstance(index, int) else None
        tb = tb.tb_next
    return None


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
        exc_type, message, formatted = describe_exception(exc)
        return cls(index, exc_type, message, formatted, _pickled(exc))

    def shifted(self, offset: int) -> EnvFailure:
        """The same failure with its env index counted ``offset`` envs further (a part within a slice)."""
        return self if self.env_index is None else replace(self, env_index=self.env_index + offset)


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """``(type name, message, traceback)`` of an exception, each cut to its bound; never raises."""
    exc_type = _clip(type(exc).__name__, _MAX_TYPE_NAME_BYTES)
    return exc_type, _clip(_text_of(exc), MAX_MESSAGE_BYTES), _clip(_traceback_of(exc), MAX_TRACEBACK_BYTES)


def _text_of(exc: BaseException) -> str:
    """``str(exc)``; ``repr(exc)`` if that raises (C++ simulators' wrappers do); else the type's name."""
    for text in (str, repr):
        try:
            return text(exc)
        except Exception:
            continue
    return type(exc).__name__


def _traceback_of(exc: BaseException) -> str:
    """The exception formatted as Python prints it (with its chained causes), or as much of that as formats."""
    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:
        try:
            return "".join(traceback.format_tb(exc.__traceback__)) + f"{type(exc).__name__}: {_text_of(exc)}\n"
        except Exception:
            return ""


def _clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` UTF-8 bytes: its head and tail around a marked cut; lone surrogates escaped."""
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return data.decode("utf-8")
    marker = f"\n[... {len(data)} bytes in all; the middle was cut ...]\n".encode()
    keep = max(0, limit - len(marker))
    head = data[: keep - keep // 2].decode("utf-8", "ignore")
    tail = data[len(data) - keep // 2 :].decode("utf-8", "ignore")
    return head + marker.decode() + tail


def _pickled(exc: BaseException) -> bytes | None:
    """The exception cloudpickled, if it pickles within :data:`MAX_PICKLED_BYTES`."""
    try:
        data = cloudpickle.dumps(exc)
    except Exception:
        return None
    return data if len(data) <= MAX_PICKLED_BYTES else None


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
