"""The ledger of cut episodes: which workers' envs lost their episode to the learner's own doing, and why.

A worker's envs are cut when a new process builds them afresh: the worker was lost and
replaced or re-homed, recycled, or moved by ``rebalance``. Their episodes end there, and
every stepping mode reports that once, the same way (truncated, reward 0,
``infos["worker_restarted"]``): a lockstep ``step`` in the step after the cut, first-ready
``recv`` with the fresh envs' first results, a ``PolicyRunner`` rollout at its first step.
Whoever causes a cut records it here; whoever reports it takes it, so a cut is never
reported twice nor lost between the two. An env's own error under ``on_env_error="reset"``
is cut inside the worker, which flags it in the env's infos (``env_error``), not here.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

__all__ = ["Cut", "CutLedger"]

logger = logging.getLogger(__name__)


class Cut(enum.Enum):
    """Why a worker's envs were built afresh."""

    RESTARTED = "restarted"  # lost, and replaced by a new process (on_worker_failure="restart")
    REHOMED = "rehomed"  # lost, and its envs rebuilt in a surviving process ("rehome")
    RECYCLED = "recycled"  # replaced while healthy (Recycle)
    MOVED = "moved"  # moved to another process to even the load (rebalance)


class CutLedger:
    """Which workers' envs were cut and not yet reported, with why."""

    def __init__(self) -> None:
        self._cuts: dict[int, Cut] = {}

    def record(self, worker_id: int, why: Cut) -> None:
        """Worker ``worker_id``'s envs were built afresh: their episodes end, to be reported once."""
        logger.debug("Worker %d's episodes were cut (%s).", worker_id, why.value)
        self._cuts[worker_id] = why

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._cuts

    def __bool__(self) -> bool:
        return bool(self._cuts)

    def take(self, worker_ids: Iterable[int] | None = None) -> dict[int, Cut]:
        """The cuts of ``worker_ids`` (``None``: all) in worker order, cleared: the caller reports them now."""
        chosen = sorted(self._cuts if worker_ids is None else set(worker_ids).intersection(self._cuts))
        return {w: self._cuts.pop(w) for w in chosen}

    def settle(self, worker_ids: Iterable[int]) -> None:
        """These workers' cuts need no report: their envs start new episodes anyway (a full reset, a fresh rollout)."""
        for worker_id in worker_ids:
            self._cuts.pop(worker_id, None)
