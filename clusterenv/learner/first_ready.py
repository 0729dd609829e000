"""First-ready batches (EnvPool's ``async_reset``/``send``/``recv``): which workers step, which replied.

A worker's envs are in one of three hands: the caller's (``recv`` returned them), in flight
(``send`` or ``async_reset`` gave them work), or arrived (replied, waiting for ``recv``).
``recv`` returns the envs of the first workers to reply, whole workers at a time, so that
each env's trajectory is exactly that of the env stepped alone.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from gymnasium.error import NoAsyncCallError

from clusterenv.errors import WorkerTimeoutError
from clusterenv.learner.cuts import Cut, CutLedger
from clusterenv.learner.pool import FollowUp, OnLoss, WorkerPool
from clusterenv.learner.recycling import Recycler
from clusterenv.learner.step_buffers import BatchBuffers, restarted_records
from clusterenv.wire.infos import merge_infos, records_of
from clusterenv.wire.messages import ResetMeta
from clusterenv.wire.protocol import STEP_FIELDS, Kind, Message, step_fields

__all__ = ["FirstReady", "Ready"]

#: What ``recv`` returns: ``(obs, rewards, terminations, truncations, infos, env_ids)``.
Ready = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any], np.ndarray]


#: Which rows of a send()'s actions each worker steps: ``[(worker, rows)]``, ``rows`` a slice when consecutive.
Plan = list[tuple[int, slice | np.ndarray]]


def _as_rows(rows: np.ndarray) -> slice | np.ndarray:
    """``rows`` as a slice when consecutive, so that leaves are sliced, not copied.

    Consecutive rows are the usual case: env_ids as recv() gave them.

    Rows holding -1 (envs not given) stay an array, for :meth:`FirstReady.plan` to refuse.
    """
    start = int(rows[0])
    if start >= 0 and (len(rows) == 1 or (rows[-1] - start == len(rows) - 1 and (np.diff(rows) == 1).all())):
        return slice(start, start + len(rows))
    return rows


class FirstReady:
    """The first-ready bookkeeping of one ``ClusterEnv``: in-flight and arrived workers."""

    def __init__(self, slices: list[slice], num_envs: int) -> None:
        self._slices = slices
        self._num_envs = num_envs
        self._env_worker = np.repeat(np.arange(len(slices)), [sl.stop - sl.start for sl in slices])
        #: Workers given work, and what: ``"reset"``, ``"step"`` or ``"restarted"`` (a replacement's reset).
        self.in_flight: dict[int, str] = {}
        self._arrived: list[tuple[int, str, Message]] = []
        # The env_ids recv() last returned and their plan: the usual send() gives them back as they were.
        self._returned: tuple[np.ndarray, Plan] | None = None

    def busy_workers(self) -> list[int]:
        """Workers whose envs are not in the caller's hands: stepping, or replied and not yet recv()'d."""
        if not self.in_flight and not self._arrived:  # every lockstep call asks: the common answer, at once
            return []
        return [*self.in_flight, *(w for w, _, _ in self._arrived)]

    def envs_in_flight(self) -> int:
        """How many envs the :meth:`busy_workers` step."""
        return sum(self._slices[w].stop - self._slices[w].start for w in self.busy_workers())

    def plan(self, env_ids: Any) -> tuple[int, Plan]:
        """How many envs ``env_ids`` names, and the :data:`Plan` of its send.

        ``env_ids`` must name whole workers' envs that recv() returned.
        """
        returned = self._returned
        if (
            returned is not None
            and type(env_ids) is np.ndarray
            and env_ids.shape == returned[0].shape
            and bool((env_ids == returned[0]).all())
        ):
            plan = returned[1]  # what the checks below would find, without them: the rows recv() gave
            self._refuse_busy([w for w, _ in plan])
            return len(env_ids), plan
        env_ids = np.asarray(env_ids)
        if env_ids.ndim != 1 or env_ids.dtype.kind not in "iu" or not len(env_ids):
            raise ValueError(f"`env_ids` must be a non-empty 1-d array of env indices, got {env_ids!r}.")
        if env_ids.min() < 0 or env_ids.max() >= self._num_envs or len(np.unique(env_ids)) != len(env_ids):
            raise ValueError(f"`env_ids` must be distinct indices in [0, {self._num_envs}), got {env_ids.tolist()}.")
        position = np.full(self._num_envs, -1)  # -1: an env of a worker whose other envs were not given
        position[env_ids] = np.arange(len(env_ids))
        workers = np.unique(self._env_worker[env_ids]).tolist()
        plan = [(w, _as_rows(position[self._slices[w]])) for w in workers]
        self._refuse_busy(workers)
        for w, rows in plan:
            if isinstance(rows, np.ndarray) and (rows < 0).any():
                sl = self._slices[w]
                raise ValueError(
                    f"`env_ids` must hold whole workers' envs, as recv() returns them: worker {w} steps "
                    f"envs {sl.start}..{sl.stop - 1}, but only some of them were given."
                )
        return len(env_ids), plan

    def _refuse_busy(self, workers: list[int]) -> None:
        busy = sorted(set(workers).intersection(self.busy_workers()))
        if busy:
            raise ValueError(
                f"`env_ids` include envs of workers {busy} whose last results recv() has not returned yet: "
                "send() takes the envs that recv() returned."
            )

    def send(self, pool: WorkerPool, leaves: list[np.ndarray], plan: Plan, recycler: Recycler | None) -> None:
        """Step the workers of ``plan`` with their rows of the checked action ``leaves``, without waiting.

        A replacement's envs are reset by the restart hook, and recv() reports their cut episodes;
        a moved worker's (rebalance, recycling) are reset here instead of stepped, and reported the same way.
        """
        cuts = pool.cuts
        if recycler is not None:
            recycler.before_step([w for w, _ in plan], cuts, self._slices)
        moved = cuts.take(w for w, _ in plan)
        stepping = [(w, rows) for w, rows in plan if w not in moved]
        commands = {w: (None, [leaf[rows] for leaf in leaves], ()) for w, rows in stepping}
        pool.send_each(Kind.STEP, commands, OnLoss.REISSUE)
        self.in_flight.update((w, "step") for w, _ in stepping)
        for w in moved:
            self._reset_moved(pool, w)

    def wait(
        self, pool: WorkerPool, needed: int, batch_size: int, timeout: float | None
    ) -> list[tuple[int, str, Message]]:
        """The replies of the first ``needed`` workers to be ready (``batch_size`` envs), in the order they replied."""
        if len(self.busy_workers()) < needed:
            raise NoAsyncCallError(
                f"recv() returns batch_size={batch_size} envs, but only {self.envs_in_flight()} "
                "are in flight: send() actions for more envs first.",
                "step",
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._arrived) < needed:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            received = pool.receive("stepping", remaining)
            if received is None:
                raise WorkerTimeoutError(
                    f"recv() waited {timeout} s for {needed - len(self._arrived)} more workers' envs; workers "
                    f"{sorted(self.in_flight)} are still stepping. Their envs stay in flight: call recv() again."
                )
            w, msg = received
            if w in self.in_flight:
                self._arrived.append((w, self.in_flight.pop(w), msg))
        ready, self._arrived = self._arrived[:needed], self._arrived[needed:]
        return ready

    def assemble(self, ready: list[tuple[int, str, Message]], buffers: BatchBuffers) -> Ready:
        """The batch ``recv`` returns for the ``ready`` workers' envs, rows in reply order."""
        env_ids = np.concatenate([np.arange(self._slices[w].start, self._slices[w].stop) for w, _, _ in ready])
        n = len(env_ids)
        rewards, terminations, truncations = np.zeros(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_)
        infos: dict[str, Any] = {}
        offset = 0
        plan: Plan = []
        for w, what, msg in ready:
            sl = self._slices[w]
            rows = slice(offset, offset + sl.stop - sl.start)
            plan.append((w, rows))
            buffers.write_observations(sl, msg, n_extra=len(STEP_FIELDS) if what == "step" else 0)
            if what == "step":
                rewards[rows], terminations[rows], truncations[rows] = step_fields(msg)
            payload = buffers.infos_of(msg)
            if what == "restarted":  # a replacement's fresh envs: the cut episodes end here
                truncations[rows] = True
                payload = restarted_records(rows.stop - rows.start, dict(records_of(payload)))
            if payload:
                infos = merge_infos(infos, payload, n, offset)
            offset = rows.stop
        self._returned = (env_ids.copy(), plan)  # a copy: the caller may write into the env_ids it gets
        return buffers.rows(env_ids), rewards, terminations, truncations, infos, env_ids

    def restart_hook(self, worker_id: int, cuts: CutLedger, cut: Cut) -> list[FollowUp]:
        """What a replaced (or re-homed, ``cut``) worker's fresh envs need: reset now, or their cut recorded.

        Lost while its envs were in the caller's hands (recv() returned them), the next send()
        resets the fresh envs instead of stepping them, and recv() reports the cut.
        """
        if worker_id in self.in_flight:
            return self.reset_replacement(worker_id)
        if self.busy_workers():
            cuts.record(worker_id, cut)
        return []

    def reset_replacement(self, worker_id: int) -> list[FollowUp]:
        """For a restart hook: a replacement for a worker lost mid-``send`` is reset, and recv() reports the cut.

        A reset in flight needs nothing here: the pool replays it, and its seeds give the
        replacement's envs the observations the lost worker's would have had.
        """
        return [self.fresh_reset(worker_id)] if self.in_flight.get(worker_id) == "step" else []

    def fresh_reset(self, worker_id: int) -> FollowUp:
        """The RESET of a replaced or moved worker's fresh envs, now in flight; recv() reports the cut."""
        sl = self._slices[worker_id]
        self.in_flight[worker_id] = "restarted"
        return FollowUp(Kind.RESET, ResetMeta(seeds=[None] * (sl.stop - sl.start), mask=None), on_loss=OnLoss.REPLAY)

    def _reset_moved(self, pool: WorkerPool, worker_id: int) -> None:
        """Reset the fresh envs of a moved worker now (see :meth:`fresh_reset`)."""
        reset = self.fresh_reset(worker_id)
        pool.send(worker_id, reset.kind, reset.meta, on_loss=reset.on_loss)
