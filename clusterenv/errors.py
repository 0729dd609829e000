"""Exceptions raised by clusterenv.

The tree, so that callers can catch as broadly or narrowly as they need::

    ClusterEnvError
    ├── RemoteEnvError        an environment raised inside a worker, or in the learner's own share
    │                         (``learner_envs``), traceback attached; each instance is also of the
    │                         original exception's type
    ├── WorkerLostError       a worker process died or stopped answering heartbeats
    ├── WorkerTimeoutError    a reply did not arrive within ``timeout`` (also a ``TimeoutError``
    │                         and a ``multiprocessing.TimeoutError``, as ``AsyncVectorEnv`` raises)
    ├── WorkerStartError      workers could not be started or did not join in time
    ├── ProtocolError         a message could not be decoded
    │   └── AuthenticationError   a message failed its MAC check
    ├── UntrustedPickleError  a remote worker's reply names a class outside ``trusted_classes``
    └── PolicyError           a policy is unusable with this environment

Gymnasium's own ``AlreadyPendingCallError``, ``NoAsyncCallError`` and
``ClosedEnvironmentError`` are raised unchanged, as ``AsyncVectorEnv`` does.
"""

from __future__ import annotations

import builtins
import multiprocessing
import pickle

__all__ = [
    "AuthenticationError",
    "ClusterEnvError",
    "PolicyError",
    "ProtocolError",
    "RemoteEnvError",
    "UntrustedPickleError",
    "WorkerLostError",
    "WorkerStartError",
    "WorkerTimeoutError",
    "builtin_exception_type",
    "remote_error_type",
]


class ClusterEnvError(Exception):
    """Base class of every error clusterenv raises itself."""


class RemoteEnvError(ClusterEnvError):
    """An environment raised inside a worker, or among the envs the learner steps itself (``learner_envs``).

    What is raised is an instance of a subclass of both ``RemoteEnvError`` and the original
    exception's type (see :func:`remote_error_type`), as Ray's ``RayTaskError`` does, so that
    ``except ValueError`` catches a ``ValueError`` raised by a remote env exactly as it
    would with ``SyncVectorEnv``, and ``except RemoteEnvError`` catches every remote error.
    The original exception, when it could be pickled, is attached as ``__cause__``. An env the
    learner steps itself raises the very same error, built from the same captured text and
    pickled exception, so that where an env runs changes nothing.

    Attributes:
        env_index: the global index of the env that raised (``None``: not known).
        worker_id: the worker that ran it (``None``: the learner itself, ``learner_envs``).
        exc_type: the name of the original exception's type.
        remote_traceback: the traceback, formatted where the env raised.
    """

    def __init__(
        self,
        message: str,
        *,
        env_index: int | None,
        worker_id: int | None,
        exc_type: str,
        remote_traceback: str,
    ) -> None:
        # Not super(): the original type's __init__ may take other arguments (UnicodeDecodeError takes 5).
        Exception.__init__(self, message)
        self.env_index = env_index
        self.worker_id = worker_id
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        # The default reduction replays only ``args``; keep the keyword-only fields too (pytest-xdist, Ray).
        # A per-type subclass is made at run time, so it travels as the original type it stands for.
        return (_rebuild_remote_env_error, (getattr(type(self), "remote_type", None), self.args[0], self.__dict__))


_REMOTE_TYPES: dict[type[BaseException], type[RemoteEnvError]] = {}


def remote_error_type(original: type[BaseException] | None) -> type[RemoteEnvError]:
    """The subclass of ``RemoteEnvError`` and ``original`` that a remote ``original`` is raised as.

    One class per original type (cached), named ``RemoteEnvError[ValueError]``. Falls back
    to plain ``RemoteEnvError`` when there is no original type, when it is not an
    ``Exception`` subclass (``KeyboardInterrupt``, ``SystemExit`` must not be caught as env
    errors), or when Python cannot combine the two classes.
    """
    if original is None or not issubclass(original, Exception) or issubclass(original, RemoteEnvError):
        return RemoteEnvError
    if original not in _REMOTE_TYPES:
        try:
            combined = type(
                f"RemoteEnvError[{original.__name__}]",
                (RemoteEnvError, original),
                {"remote_type": original, "__module__": __name__, "__str__": RemoteEnvError.__str__},
            )
        except TypeError:  # e.g. an extension type that does not allow subclassing
            return RemoteEnvError
        _REMOTE_TYPES[original] = combined
    return _REMOTE_TYPES[original]


def builtin_exception_type(name: str) -> type[BaseException] | None:
    """The built-in exception class called ``name`` (``"ValueError"``), if there is one."""
    value = getattr(builtins, name, None)
    return value if isinstance(value, type) and issubclass(value, BaseException) else None


def _rebuild_remote_env_error(original: type[BaseException] | None, message: str, state: dict) -> RemoteEnvError:
    cls = remote_error_type(original)
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class WorkerLostError(ClusterEnvError):
    """A worker process exited, was killed, or stopped sending heartbeats."""


class WorkerTimeoutError(ClusterEnvError, TimeoutError, multiprocessing.TimeoutError):
    """A worker did not reply within the timeout.

    Also a ``multiprocessing.TimeoutError``, which is what ``AsyncVectorEnv.step_wait(timeout=)``
    raises, so code written against Gymnasium catches it unchanged.
    """


class WorkerStartError(ClusterEnvError):
    """Workers could not be started, or did not join in time."""


class ProtocolError(ClusterEnvError):
    """A message was malformed, truncated, oversized or of an unknown kind."""


class AuthenticationError(ProtocolError):
    """A message's MAC did not match: the peer does not hold the shared secret."""


class UntrustedPickleError(ClusterEnvError, pickle.UnpicklingError):
    """A worker the learner did not start sent a pickle naming a class or function it does not load.

    Unpickling runs the callables a pickle names, so replies from external and Ray workers
    may hold data only, plus the classes given in ``ClusterEnv(..., trusted_classes=...)``.
    """


class PolicyError(ClusterEnvError, ValueError):
    """A policy cannot be used: wrong output shape, not picklable, bad threshold."""
