"""The learner's movement: its own per-version change on each worker's probe states, the unit of ``APS()``'s bound.

At every publish the learner keeps the version it replaces. When it computes its outputs on a
worker's probe states for a KL check, it also computes the replaced version's, and
``KL(π_v ‖ π_{v-1})`` averaged over those states is one measurement of how far one version
moves the policy there. Measurements are smoothed over versions (an exponential moving
average, :data:`~clusterenv.policy.strategies.MOVEMENT_SMOOTHING`): at most once per version and
worker, at the worker's next KL check, so several publishes between two rollouts count as the
last one's step. A step that is not finite (a greedy head's infinite KL) is left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from clusterenv.policy.strategies import MOVEMENT_SMOOTHING, Telemetry

if TYPE_CHECKING:
    from torch import nn

    from clusterenv.policy.heads import Head
    from clusterenv.policy.shipping import LocalPolicy

__all__ = ["LearnerMovement"]


class LearnerMovement:
    """Per worker, the smoothed KL between the learner's consecutive versions on that worker's probe states."""

    def __init__(self, previous: LocalPolicy, telemetry: Telemetry) -> None:
        self._previous = previous  # the version before the learner's latest
        self._telemetry = telemetry
        self._estimates: list[float | None] = [None] * len(telemetry.workers)
        self._measured_at: list[int] = [0] * len(telemetry.workers)

    def replacing(self, learner: nn.Module, version: int) -> None:
        """Keep the learner's copy at ``version`` as the previous version, before a publish overwrites it."""
        self._previous.copy_from(learner, version)

    def measure(self, head: Head, obs: Any, latest: np.ndarray, slices: list[slice | None], version: int) -> None:
        """Update each worker's estimate from the learner's ``latest`` outputs on the concatenated probe states ``obs``.

        ``slices[w]`` is worker ``w``'s rows (None: no probe states). A worker measured at this
        version already keeps its estimate; before the first publish nothing has moved.
        """
        due = [w for w, rows in enumerate(slices) if rows is not None and self._measured_at[w] != version]
        if version == 0 or not due:
            return
        previous = self._previous.outputs(obs)
        for worker_id in due:
            rows = slices[worker_id]
            step = float(np.mean(head.kl(latest[rows], previous[rows])))
            if not np.isfinite(step):
                continue
            estimate = self._estimates[worker_id]
            smoothed = step if estimate is None else MOVEMENT_SMOOTHING * estimate + (1 - MOVEMENT_SMOOTHING) * step
            self._estimates[worker_id], self._measured_at[worker_id] = smoothed, version
            self._telemetry.workers[worker_id].movement = smoothed

    def of(self, worker_id: int) -> float | None:
        """Worker ``worker_id``'s estimate, or None before its first measurement."""
        return self._estimates[worker_id]
