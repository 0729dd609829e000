"""Exceptions raised by clusterenv.

The tree, so that callers can catch as broadly or narrowly as they need::

    ClusterEnvError
    ├── RemoteEnvError        an environment raised inside a worker (remote traceback attached)
    ├── WorkerLostError       a worker process died or stopped answering heartbeats
    ├── WorkerTimeoutError    a reply did not arrive within ``timeout`` (also a ``TimeoutError``)
    ├── WorkerStartError      workers could not be started or did not join in time
    ├── ProtocolError         a message could not be decoded
    │   └── AuthenticationError   a message failed its HMAC check
    ├── UntrustedPickleError  a remote worker's reply names a class outside ``trusted_classes``
    └── PolicyError           a policy is unusable with this environment

Gymnasium's own ``AlreadyPendingCallError``, ``NoAsyncCallError`` and
``ClosedEnvironmentError`` are raised unchanged, as ``AsyncVectorEnv`` does.
"""

from __future__ import annotations

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
]


class ClusterEnvError(Exception):
    """Base class of every error clusterenv raises itself."""


class RemoteEnvError(ClusterEnvError):
    """An environment raised inside a worker.

    The original exception, when it could be pickled, is attached as ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        env_index: int | None,
        worker_id: int,
        exc_type: str,
        remote_traceback: str,
    ) -> None:
        super().__init__(message)
        self.env_index = env_index
        self.worker_id = worker_id
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        # The default reduction replays only ``args``; keep the keyword-only fields too (pytest-xdist, Ray).
        return (_rebuild_remote_env_error, (type(self), self.args[0], self.__dict__))


def _rebuild_remote_env_error(cls: type[RemoteEnvError], message: str, state: dict) -> RemoteEnvError:
    error = cls.__new__(cls)
    ClusterEnvError.__init__(error, message)
    error.__dict__.update(state)
    return error


class WorkerLostError(ClusterEnvError):
    """A worker process exited, was killed, or stopped sending heartbeats."""


class WorkerTimeoutError(ClusterEnvError, TimeoutError):
    """A worker did not reply within the timeout."""


class WorkerStartError(ClusterEnvError):
    """Workers could not be started, or did not join in time."""


class ProtocolError(ClusterEnvError):
    """A message was malformed, truncated, oversized or of an unknown kind."""


class AuthenticationError(ProtocolError):
    """A message's HMAC did not match: the peer does not hold the shared secret."""


class UntrustedPickleError(ClusterEnvError, pickle.UnpicklingError):
    """A worker the learner did not start sent a pickle naming a class or function it does not load.

    Unpickling runs the callables a pickle names, so replies from external and Ray workers
    may hold data only, plus the classes given in ``ClusterEnv(..., trusted_classes=...)``.
    """


class PolicyError(ClusterEnvError, ValueError):
    """A policy cannot be used: wrong output shape, not picklable, bad threshold."""
