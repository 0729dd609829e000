"""``Lockstep``: ``ClusterEnv.step`` when every worker steps through the shared step region.

The common step, in one place (:meth:`Lockstep.step`). The actions are checked against the
region's dtype and shape at a glance, recorded, copied into the region, and every worker is
commanded with one fence; the learner's own envs (``learner_envs``) step meanwhile; each
worker's answer is read from its words (a spin, then a blocking read of its wake socket); the
batch is returned from the region. No message is built and nothing is kept per worker.

Anything else is not a lockstep step, and ``ClusterEnv.step`` takes its general path, which
also raises every error a step can raise (a pending call, actions that do not fit). A step
that starts here and then meets anything unusual is left, as recorded, to the pool's receive
loop (``step_wait``, :meth:`~clusterenv.learner.pool.WorkerPool.gather`): a reply that is a
message (a usage report, a new info layout, an error), a worker slower than one blocking read,
the pool due to read its socket or check liveness, an interrupt (Ctrl-C). The words are the
truth and nothing is taken here before every worker has answered, so the loop finds every
reply where this step left it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
from gymnasium import spaces

from clusterenv.learner.call_state import AsyncState, CallState
from clusterenv.learner.env_calls import EnvCalls
from clusterenv.learner.first_ready import FirstReady
from clusterenv.learner.own_envs import LearnerEnvs
from clusterenv.learner.pool import WorkerPool
from clusterenv.learner.shared_steps import SharedSteps
from clusterenv.learner.step_buffers import BatchBuffers
from clusterenv.learner.validation import check_actions
from clusterenv.wire.infos import merge_infos
from clusterenv.wire.pipes import WAKE_READ_TIMEOUT_S
from clusterenv.wire.step_region import INFOS

__all__ = ["NOT_LOCKSTEP", "Lockstep", "StepResult"]

StepResult = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]
LeafSpec = tuple[np.dtype, tuple[int, ...], spaces.Space]


class _NotLockstep:
    """:meth:`Lockstep.step`'s answer for a step it did not start: ``ClusterEnv.step``'s general path takes it."""


#: The step was not started: ``ClusterEnv.step`` sends it on its general path.
NOT_LOCKSTEP: Final = _NotLockstep()


class Lockstep:
    """The lockstep step of a ``ClusterEnv`` whose workers are on the shared step path.

    Args:
        pool: the env's pool (its ``step_path`` set).
        buffers: the env's batch (the region's arrays).
        call: the env's pending call; ``first_ready``: its envs in flight (a lockstep step waits for none).
        own: the envs the learner steps itself, if any; ``env_calls``: the env's calls (their part of a step).
        action_space: one env's action space; ``specs``: its leaves (``leaf_specs``).
        copy: whether the returned observations are a fresh copy (``ClusterEnv(copy=)``).
    """

    def __init__(
        self,
        pool: WorkerPool,
        buffers: BatchBuffers,
        call: CallState,
        first_ready: FirstReady,
        own: LearnerEnvs | None,
        env_calls: EnvCalls,
        action_space: spaces.Space,
        specs: list[LeafSpec],
        copy: bool,
    ) -> None:
        path = pool.step_path
        assert path is not None
        self._pool = pool
        self._path: SharedSteps = path
        self._buffers = buffers
        self._call = call
        self._first_ready = first_ready
        self._env_calls = env_calls
        self._own = own
        self._action_space = action_space
        self._specs = specs
        self._copy = copy
        region = path.region
        self._num_envs = region.num_envs
        #: The workers (all of them step in a lockstep step).
        self.workers = list(range(len(region.slices)))
        self._offsets = [sl.start for sl in region.slices]
        # A single-leaf action space (Discrete, Box, ...) whose batch has the region's form is checked at a glance.
        self._form = (region.actions[0].dtype, region.actions[0].shape) if len(region.actions) == 1 else None

    def step(self, actions: Any, run_own: Callable[[], None]) -> StepResult | _NotLockstep | None:
        """Step every env through the region: the batch; ``NOT_LOCKSTEP``: not started; ``None``: for ``step_wait``.

        Recorded, then pending, then sent: wherever an interrupt (Ctrl-C) lands, ``step_wait``
        finishes the step exactly. ``run_own`` steps the learner's own envs (after the workers
        are commanded, before their replies are read). ``ClusterEnv.step`` has checked that the
        env is open, reset, and recycles no worker.
        """
        call, pool = self._call, self._pool
        if call.state is not AsyncState.DEFAULT or self._first_ready.busy_workers() or not pool.can_step_shared():
            return NOT_LOCKSTEP
        leaves = self._leaves(actions)
        if leaves is None:
            return NOT_LOCKSTEP
        seq = pool.new_call()
        self._env_calls.expect_own_step(leaves, None, self._action_space)
        outbox = pool.outbox
        outbox.record_shared(leaves)
        call.state, call.pending = AsyncState.WAITING_STEP, self.workers
        outbox.command_shared(seq)
        if self._own is not None:
            run_own()
        answers = self._answers()
        if answers is None:
            return None
        # Every worker answered: an interrupt from here on loses only the results.
        call.state = AsyncState.DEFAULT
        return self._results(answers)

    def _leaves(self, actions: Any) -> list[np.ndarray] | None:
        """The batch's action leaves if they go into the region as they are; ``None``: of another form.

        Raises as ``ClusterEnv.step`` does for actions that do not fit the action space.
        """
        form = self._form
        if form is not None and type(actions) is np.ndarray and actions.dtype == form[0] and actions.shape == form[1]:
            return [actions]
        leaves = check_actions(actions, self._action_space, self._specs, self._num_envs)
        return leaves if self._path.takes(leaves) else None

    def _answers(self) -> list[int] | None:
        """Each worker's answer (its final status) once every worker answered in its rows; ``None``: the pool's loop.

        Nothing is taken yet, so a step interrupted here is finished by the pool's receive loop.
        """
        pool, path = self._pool, self._path
        if not pool.may_wait_on_words():
            return None
        answers = []
        for worker_id in self.workers:
            answer = path.final_status(worker_id)  # a worker stepping beside the learner's own envs: answered already
            if answer is None:
                if not path.await_words(worker_id, WAKE_READ_TIMEOUT_S):
                    return None
                answer = path.final_status(worker_id)
                if answer is None:  # a message, or words to be named as strays
                    return None
            answers.append(answer)
        return answers

    def _results(self, answers: list[int]) -> StepResult:
        """What ``step`` returns once every worker answered: the step's replies are taken here."""
        path, buffers, own = self._path, self._buffers, self._own
        path.all_taken()
        infos: dict[str, Any] = {}
        if own is not None:
            reply = own.take_reply()
            if not own.took(reply):  # else a step without infos, in the batch already
                infos = buffers.collect([(own.slice, reply)], step=True)
        if INFOS in answers:
            batch = path.batch_infos() if own is None and answers.count(INFOS) == len(answers) else None
            if batch is not None:  # every env reported the same scalars: the batch's arrays, from the rows at once
                infos = batch
            else:
                for worker_id, answer in enumerate(answers):
                    if answer == INFOS:
                        infos = merge_infos(
                            infos, path.infos_in_rows(worker_id), self._num_envs, self._offsets[worker_id]
                        )
        self._pool.took_shared_step()
        return buffers.step_batch(self._copy, infos)
