"""Recycling worker processes: a fresh process for a worker after so many env steps, or past a memory bound.

Some simulators leak memory over long runs. ``ClusterEnv(recycle=Recycle(...))`` replaces a
worker's process between steps, the way ``on_worker_failure="restart"`` replaces a lost one:
the worker's envs are rebuilt from their factories in the new process, and the next step
reports their cut episodes as truncated with ``infos["worker_restarted"]``. At most one
worker is replaced per batch step (lockstep ``step``, first-ready ``send``), inside that
call: a lockstep step waits for the new process; in first-ready mode the other workers'
envs stay in flight meanwhile. Workers must be the learner's own (``LocalLauncher``): resident
memory is read from ``/proc``, and only the learner can start the replacement.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from clusterenv.learner.cuts import Cut, CutLedger
from clusterenv.learner.pool import FollowUp, WorkerPool, weak_callback
from clusterenv.learner.validation import check_count, check_seconds
from clusterenv.wire.processes import resource_usage

__all__ = ["Recycle", "Recycler"]


@dataclass(frozen=True)
class Recycle:
    """When to replace a worker's process.

    Attributes:
        after_env_steps: replace a worker once its process has stepped this many env steps (over
            all its envs; ``None``: never on that count).
        rss_mb: replace a worker once its process and its env processes hold more resident memory
            than this many MB (``None``: never on that count).
        check_every_s: how often the memory is read (every worker's ``/proc`` files).
    """

    after_env_steps: int | None = None
    rss_mb: float | None = None
    check_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.after_env_steps is not None and check_count("after_env_steps", self.after_env_steps) == 0:
            raise ValueError("`after_env_steps` must be at least 1, or None.")
        check_seconds("rss_mb", self.rss_mb, allow_none=True, unit="MB")
        check_seconds("check_every_s", self.check_every_s, allow_none=False)
        if self.after_env_steps is None and self.rss_mb is None:
            raise ValueError("Recycle() needs `after_env_steps` or `rss_mb` (or both).")


class Recycler:
    """Counts each worker process's env steps, reads its memory now and then, and replaces one that is due."""

    def __init__(self, policy: Recycle, pool: WorkerPool) -> None:
        if not isinstance(policy, Recycle):
            raise TypeError(
                f"`recycle` must be a clusterenv.Recycle or None, got {type(policy).__name__} ({policy!r})."
            )
        if not pool.members.starts_local_workers:
            raise ValueError(
                "Recycling worker processes needs workers this learner starts itself (launcher='local'): "
                "it reads their memory from /proc and starts their replacements."
            )
        self.policy = policy
        self.pool = pool
        self.env_steps: dict[int, int] = {}  # per worker, since its process started
        self.rss_mb: dict[int, float] = {}  # per worker, at the last reading
        self._read_due = 0.0
        # A worker restarted after a loss, or moved, starts its count again, as a recycled one does.
        pool.on_restart(weak_callback(self._started_afresh))

    def stepped(self, counts: Mapping[int, int]) -> None:
        """Note that each worker ``w`` in ``counts`` was sent ``counts[w]`` env steps."""
        for worker_id, count in counts.items():
            self.env_steps[worker_id] = self.env_steps.get(worker_id, 0) + count

    def due(self, candidates: Iterable[int]) -> int | None:
        """The one worker among ``candidates`` to replace now, if any (the most overdue first)."""
        policy, reasons = self.policy, {}
        if policy.rss_mb is not None and time.monotonic() >= self._read_due:
            self._read_due = time.monotonic() + policy.check_every_s
            for worker_id, pid in self.pool.members.local_pids().items():
                usage = resource_usage(pid)
                if usage is not None:
                    self.rss_mb[worker_id] = usage.rss_mb
        for worker_id in candidates:
            if not self.pool.members.serves_only_itself(worker_id):
                continue  # under "rehome", a process carrying other workers' envs is left alone
            if policy.after_env_steps is not None and self.env_steps.get(worker_id, 0) >= policy.after_env_steps:
                reasons[worker_id] = self.env_steps[worker_id] / policy.after_env_steps
            if policy.rss_mb is not None and self.rss_mb.get(worker_id, 0.0) > policy.rss_mb:
                reasons[worker_id] = max(reasons.get(worker_id, 0.0), self.rss_mb[worker_id] / policy.rss_mb)
        return max(reasons, key=reasons.__getitem__) if reasons else None

    def before_step(self, candidates: Iterable[int], cuts: CutLedger, slices: list[slice]) -> None:
        """Replace the worker among ``candidates`` that is due, if any, and count the env steps about to be sent.

        The replaced worker's cut is recorded in ``cuts``: its fresh envs do not step, and the step
        reports their cut episodes as truncated with ``infos["worker_restarted"]`` (as after a restart).
        """
        candidates = list(candidates)
        due = self.due(candidates)
        if due is not None:
            self.replace(due)
            cuts.record(due, Cut.RECYCLED)
        self.stepped({w: slices[w].stop - slices[w].start for w in candidates if w not in cuts})

    def replace(self, worker_id: int) -> None:
        """A new process for ``worker_id``, its envs rebuilt; the caller reports the cut episodes."""
        self.pool.replace(worker_id, f"recycling (after {self.env_steps.get(worker_id, 0)} env steps)")
        self._started_afresh(worker_id)

    def _started_afresh(self, worker_id: int) -> list[FollowUp]:
        """Worker ``worker_id``'s envs were built anew in another process: counting starts from zero."""
        self.env_steps[worker_id] = 0
        self.rss_mb.pop(worker_id, None)
        return []
