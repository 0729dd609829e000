"""How each batch step's time splits between the learner's own work and waiting for its workers.

A batch step runs from the first STEP command sent (``step``, or the first ``send`` after a
``recv``) to the batch being returned (``step``, ``recv``). Its waiting time is the time the
learner spent blocked receiving replies; the rest (encoding and sending commands, decoding
replies, assembling the batch and its infos) is the learner's own work. A run whose steps are
mostly waiting is env-bound (more workers, or cheaper envs, help); one whose steps are mostly
busy is learner-bound. The user's code between steps counts in neither. Batch steps are timed
as a worker times its env steps (:class:`~clusterenv.stepping.step_clock.BatchSampler`: the
first, then one in 8 at random), and every one is counted: a step of cheap envs costs tens of
µs, and two clock reads and a record per step would be a visible part of it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from clusterenv.stepping.step_clock import BatchSampler

__all__ = ["TIMING_WINDOW", "StepTiming"]

#: How many recent timed batch steps :meth:`StepTiming.summary` covers.
TIMING_WINDOW = 256


class StepTiming:
    """The learner's busy and waiting seconds per batch step, over the last :data:`TIMING_WINDOW` timed steps.

    Args:
        waited: the channel's running total of seconds spent blocked receiving.
    """

    def __init__(self, waited: Callable[[], float]) -> None:
        self._waited = waited
        self._open = False  # a batch step is in progress
        self._sampler = BatchSampler()  # which batch steps are timed
        self._started: float | None = None  # when the batch step in progress started, if it is timed
        self._waited_at_start = 0.0
        #: Batch steps finished so far (timed or not).
        self.batch_steps = 0
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=TIMING_WINDOW)

    def start(self) -> None:
        """A batch step's first command leaves (later ones of the same step change nothing)."""
        if self._open:
            return
        self._open = True
        if self._sampler.pick():
            self._started, self._waited_at_start = time.perf_counter(), self._waited()

    def finish(self) -> None:
        """The batch step's results are returned."""
        if not self._open:
            return
        self._open = False
        self.batch_steps += 1
        started, self._started = self._started, None
        if started is not None:
            wall, waiting = time.perf_counter() - started, self._waited() - self._waited_at_start
            self._recent.append((wall - waiting, waiting))

    def summary(self) -> dict[str, Any]:
        """``{"batch_steps", "busy_ms", "waiting_ms"}``: the count so far, and each time's median, p95 and mean."""
        if not self._recent:
            return {"batch_steps": self.batch_steps, "busy_ms": None, "waiting_ms": None}
        values = np.array(self._recent) * 1000.0
        p50, p95, mean = np.percentile(values, 50, axis=0), np.percentile(values, 95, axis=0), values.mean(axis=0)
        return {
            "batch_steps": self.batch_steps,
            **{
                name: {"p50": float(p50[i]), "p95": float(p95[i]), "mean": float(mean[i])}
                for i, name in enumerate(("busy_ms", "waiting_ms"))
            },
        }
