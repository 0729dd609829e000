"""``Lockstep``: ``ClusterEnv.step`` when every worker steps through the shared step region.

The common step, in one place. The actions are checked against the region's dtypes and
shapes (cached), copied into the region one leaf at a time, and every worker is commanded
with one fence; the learner's own envs (``learner_envs``) step meanwhile; each worker's
answer is read from its words (a spin, then a blocking read of its wake socket); the batch
is returned from the region. No message is built and nothing is kept per worker.

Anything else leaves the step, as recorded, to the pool's receive loop
(:meth:`~clusterenv.learner.pool.WorkerPool.gather`): a reply that is a message (a usage
report, a new info layout, an error), a worker slower than one blocking read, the pool due
to read its socket or check liveness, an interrupt (Ctrl-C). The words are the truth and
nothing is taken here before every worker has answered, so the loop finds every reply where
this step left it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import spaces

from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import WorkerPool
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.learner.step_buffers import BatchBuffers
from clusterenv.learner.validation import check_actions
from clusterenv.wire.infos import merge_infos
from clusterenv.wire.pipes import WAKE_READ_TIMEOUT_S
from clusterenv.wire.step_region import INFOS

__all__ = ["Lockstep", "StepResult"]

StepResult = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]
LeafSpec = tuple[np.dtype, tuple[int, ...], spaces.Space]


class Lockstep:
    """The lockstep step of a ``ClusterEnv`` whose workers are on the shared step path.

    Args:
        pool: the env's pool (its ``step_path`` set).
        buffers: the env's batch (the region's arrays).
        own: the envs the learner steps itself, if any.
        action_space: one env's action space; ``specs``: its leaves (``leaf_specs``).
        copy: whether the returned observations are a fresh copy (``ClusterEnv(copy=)``).
    """

    def __init__(
        self,
        pool: WorkerPool,
        buffers: BatchBuffers,
        own: LearnerEnvs | None,
        action_space: spaces.Space,
        specs: list[LeafSpec],
        copy: bool,
    ) -> None:
        path = pool.step_path
        assert path is not None
        self._pool = pool
        self._path: SharedSteps = path
        self._buffers = buffers
        self._own = own
        self._action_space = action_space
        self._specs = specs
        self._copy = copy
        region = path.region
        self._region_actions = region.actions
        self._num_envs = region.num_envs
        #: The workers (all of them step in a lockstep step).
        self.workers = list(range(len(region.slices)))
        self._offsets = [sl.start for sl in region.slices]
        # A single-leaf action space (Discrete, Box, ...) whose batch has the region's form is checked at a glance.
        self._form = (region.actions[0].dtype, region.actions[0].shape) if len(region.actions) == 1 else None

    def ready(self) -> bool:
        """Whether the next step can be a lockstep step: every worker on the path, nothing to recover or report."""
        return self._pool.can_step_shared()

    def leaves(self, actions: Any) -> list[np.ndarray] | None:
        """The batch's action leaves if they go into the region as they are; ``None``: of another dtype.

        Raises as ``ClusterEnv.step`` does for actions that do not fit the action space.
        """
        form = self._form
        if form is not None and type(actions) is np.ndarray and actions.dtype == form[0] and actions.shape == form[1]:
            return [actions]
        leaves = check_actions(actions, self._action_space, self._specs, self._num_envs)
        return leaves if self._path.takes(leaves) else None

    def step(self, run_own: Callable[[], None]) -> list[int] | None:
        """Send the step recorded (``pool.outbox.record_shared``) and wait until every worker answered in its rows.

        Returns each worker's answer (its final status), for :meth:`results`; ``None``: the
        pool's receive loop takes over. Nothing is taken yet, so a step interrupted here is
        finished by the pool's receive loop. ``run_own`` steps the learner's own envs (after the
        workers are commanded, before their replies are read), keeping their reply for
        whoever collects the step.
        """
        pool, path = self._pool, self._path
        pool.outbox.command_shared(pool.seq)
        if self._own is not None:
            run_own()
        if not pool.may_wait_on_words():
            return None
        answers = []
        for worker_id in self.workers:
            if not path.await_words(worker_id, WAKE_READ_TIMEOUT_S):
                return None
            answer = path.final_status(worker_id)
            if answer is None:  # a message, or words to be named as strays
                return None
            answers.append(answer)
        return answers

    def results(self, answers: list[int]) -> StepResult:
        """What ``step`` returns once every worker answered (:meth:`step`): the step's replies are taken here."""
        pool, path, buffers, own = self._pool, self._path, self._buffers, self._own
        path.all_taken()
        infos: dict[str, Any] = {} if own is None else buffers.collect([(own.slice, own.take_reply())], step=True)
        for worker_id, answer in zip(self.workers, answers, strict=True):
            if answer == INFOS:
                infos = merge_infos(infos, path.infos_in_rows(worker_id), self._num_envs, self._offsets[worker_id])
        pool.took_shared_step()
        return buffers.step_batch(self._copy, infos)
