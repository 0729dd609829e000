"""``WorkerLike``: env code that the learner runs itself (``learner_envs``), run as a worker runs it.

A ``ClusterEnv`` must not change with where an env runs, so around every call into the
envs it steps itself the learner does what a worker process does:

- **Warnings** are filtered as in a worker process, which starts with Python's default
  filters (:data:`WORKER_FILTERS`): an env's warning is shown once per location, as the
  process shows warnings (stderr, unless something such as ``logging.captureWarnings``
  took them), and never raised into the training loop, whatever its filters say
  (``-W error``, pytest's ``filterwarnings``). Filters that the training script sets do not
  reach the envs, as they do not reach a worker's.
- **An exception** raised by env code becomes the ``RemoteEnvError`` that a worker's error
  reply for it becomes: captured by the worker's own code
  (:meth:`~clusterenv.stepping.failures.EnvFailure.capture`,
  :func:`~clusterenv.stepping.failures.error_reply`) and raised by the learner's
  (:func:`~clusterenv.learner.recovery.remote_error`), so its type, ``env_index``, message,
  ``remote_traceback`` and pickled ``__cause__`` are a worker's. The exception itself, with
  its frames, stays reachable as the error's ``__context__``.

The filters are swapped in by assigning ``warnings.filters``, which Python reads on every
warning: a block costs 0.19 µs (the swap itself 0.06 µs), where ``warnings.catch_warnings()``
with a ``simplefilter`` costs 1.18 µs (timeit, Python 3.11, this project's 2-core VM) and, bumping
the filters' version each time, would make Python forget which warnings it has shown: a
warning issued at every step would be shown at every step. What sharing one process with the
training loop leaves: a warning another thread issues while the envs run meets the envs'
filters; a warning the envs showed is not shown (nor raised) again if the training code issues
the very same one (text, category and line) before the filters next change; and a worker also
applies the ``PYTHONWARNINGS`` it inherits, which the learner's share does not.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

from clusterenv.errors import RemoteEnvError
from clusterenv.learner.recovery import remote_error
from clusterenv.stepping.failures import EnvFailure, EnvTracker, error_reply

__all__ = ["WORKER_FILTERS", "WorkerLike"]

#: The warnings filters a worker process starts with: Python's own defaults (a release build run
#: without ``-W`` or ``-X dev``, as ``python -m clusterenv.worker`` is), then the default action
#: made explicit, so that no setting of the training process's ``warnings`` module raises a warning.
WORKER_FILTERS: tuple[tuple[str, Any, type[Warning], Any, int], ...] = (
    ("default", None, DeprecationWarning, "__main__", 0),
    ("ignore", None, DeprecationWarning, None, 0),
    ("ignore", None, PendingDeprecationWarning, None, 0),
    ("ignore", None, ImportWarning, None, 0),
    ("ignore", None, ResourceWarning, None, 0),
    ("default", None, Warning, None, 0),
)


class WorkerLike:
    """The learner's own envs' code, run as a worker runs it: ``with worker_like.doing("stepping"): ...``.

    One per share of envs: its warnings filters start as :data:`WORKER_FILTERS`, and what the
    env code changes in them stays with it, as in a worker process. Cheap enough for every
    step: a block costs about 0.2 µs.

    Args:
        tracker: the envs' tracker, which learns the env each loop reaches.
    """

    __slots__ = ("_doing", "_filters", "_saved", "_tracker", "misfit")

    def __init__(self, tracker: EnvTracker) -> None:
        self._tracker = tracker
        self._filters = list(WORKER_FILTERS)
        self._doing = ""
        self._saved: Any = None  # the training process's filters, while a block runs
        #: Names the env whose observation does not batch (``RecordingVectorEnv.misfit_observation``), once built.
        self.misfit: Callable[[], int | None] | None = None

    def doing(self, what: str) -> WorkerLike:
        """This, for a block in which the envs are doing ``what``, as a worker's error names it (``"stepping"``)."""
        self._doing = what
        return self

    def __enter__(self) -> None:
        self._tracker.reached = None  # a new command: no env reached yet
        self._saved = warnings.filters
        warnings.filters = self._filters

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        warnings.filters = self._saved
        if isinstance(exc, Exception):  # not an interrupt (KeyboardInterrupt) or an exit: those are the learner's
            raise _error_of(exc, self._tracker, self._doing, self.misfit)


def _error_of(
    exc: Exception, tracker: EnvTracker, doing: str, misfit: Callable[[], int | None] | None = None
) -> RemoteEnvError:
    """The ``RemoteEnvError`` a worker's ERROR reply would become for ``exc``, raised by the learner's own envs."""
    return remote_error(None, error_reply(EnvFailure.capture(exc, tracker, misfit)), doing, pickle.loads)
