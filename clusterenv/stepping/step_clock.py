"""How long each env step takes, measured in the process that steps the env.

``SyncVectorEnv`` reaches each env through its ``envs`` list just before stepping it (for a
timed batch step, the worker hands it a :class:`~clusterenv.stepping.failures.TimedEnvs`), so the time
from reaching one env to reaching the next is that env's step, plus Gymnasium's few µs of
bookkeeping for it; the last env's ends when the batch step returns. An autoreset inside a
step (``SAME_STEP``) is timed as a step of its own. One batch step in :data:`SAMPLE_EVERY` is
timed, picked at random (its first included, :class:`BatchSampler`), one ``perf_counter`` per
env step then: a sample is enough for the percentiles, and cheap envs do not pay a clock read
per step.
Workers send the median and 95th percentile to the learner at most once a second, with a reply
they send anyway, together with the process's CPU seconds and resident memory (its env
processes included, from ``/proc``).
"""

from __future__ import annotations

import collections
import os
import random
import time

import numpy as np

from clusterenv.wire.messages import UsageReport
from clusterenv.wire.processes import resource_usage

__all__ = ["REPORT_INTERVAL_S", "SAMPLE_EVERY", "BatchSampler", "StepClock"]

#: How often a worker reports its env step times (with its next reply).
REPORT_INTERVAL_S = 1.0
#: One batch step in this many is timed, on average.
SAMPLE_EVERY = 8
_SAMPLES = 1024


class BatchSampler:
    """Which batch steps are timed: the first (a figure at once), then one in :data:`SAMPLE_EVERY`, at random.

    At random, since a training loop's own period (a rollout of 128 steps, then an update)
    would otherwise have the same steps timed every time; seeded, so the same ones run after run.
    """

    def __init__(self) -> None:
        self._picks = random.Random(0)
        self._first = True

    def pick(self) -> bool:
        """Whether the batch step beginning now is timed."""
        if self._first:
            self._first = False
            return True
        return self._picks.random() * SAMPLE_EVERY < 1.0


class StepClock:
    """The durations of recent env steps, in seconds (at most the last 1,024)."""

    def __init__(self) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=_SAMPLES)
        self.running = False
        self._sampler = BatchSampler()
        self._last: float | None = None
        self._report_due = 0.0

    def reached(self) -> None:
        """An env is about to be stepped: the previous one's step ended."""
        now = time.perf_counter()
        if self._last is not None:
            self.samples.append(now - self._last)
        self._last = now

    def start(self) -> bool:
        """A batch step begins: whether it is timed (one of the sampled)."""
        self.running, self._last = self._sampler.pick(), None
        return self.running

    def stop(self) -> None:
        """The batch step ended: so did its last env's step."""
        if self.running:
            self.reached()
        self.running, self._last = False, None

    def take(self) -> list[float]:
        """The samples so far, forgotten here (an env process hands them to its worker)."""
        samples = list(self.samples)
        self.samples.clear()
        return samples

    def report(self) -> UsageReport | None:
        """This process's usage, once every :data:`REPORT_INTERVAL_S` (else ``None``): step times, CPU, memory."""
        now = time.monotonic()
        if now < self._report_due:
            return None
        # Until the first env steps, every reply reports (a run's first steps then come with times).
        self._report_due = now + REPORT_INTERVAL_S if self.samples else now
        step_ms = None
        if self.samples:
            values = np.fromiter(self.samples, dtype=np.float64) * 1000.0
            step_ms = [*np.percentile(values, [50, 95]).tolist(), float(len(values))]
        usage = resource_usage(os.getpid())  # with its env processes; None without /proc
        return UsageReport(
            env_step_ms=step_ms,
            cpu_s=None if usage is None else usage.cpu_s,
            rss_mb=None if usage is None else usage.rss_mb,
        )
