"""Rollouts with policies on the workers: the learner-side :class:`PolicyRunner`.

``PolicyRunner(envs, policy, ..., prefetch=k)`` makes the runner of one of two modes, each
a class of its own over their shared base in :mod:`clusterenv.learner.runner_base` (shipping the policy, publishing
versions, the learner's probe outputs, answering pulls, assembling batches):

- lockstep (``prefetch=0``, :class:`~clusterenv.learner.lockstep_rollouts.LockstepRunner`):
  each :meth:`PolicyRunner.rollout` asks every worker for ``T`` steps and waits; the workers
  idle while the learner trains;
- prefetch (``prefetch=k``, :class:`~clusterenv.learner.prefetched_rollouts.PrefetchingRunner`):
  each worker has up to ``k`` rollouts queued ahead of the one the learner is consuming, so
  it keeps collecting while the learner trains, with a policy copy that may lag. The flow,
  per worker::

    learner                                       worker
    ROLLOUT_AHEAD(id, T, head, learner_version) →      (queued; executed in id order)
                                           ←      ROLLOUT_RESULT(id, transitions, per-step versions)
    PROBE(id, version, outputs on id's     →      kept: the KL at the start of the next
          probe states, latest version)           rollout compares it with the current copy
                                                  on the same states
                                           ←      WEIGHTS_REQUEST (if the strategy says pull;
                                                  the worker keeps acting meanwhile)
    SET_WEIGHTS(version, weights)          →      loaded between two steps

PROBE goes out whenever a result arrives and again on every :meth:`PolicyRunner.publish`;
weight pulls are answered whenever the learner is inside ``rollout``, ``fragments`` or
``publish``. Each step records the version that acted, so the batch carries its lag.
The worker side is :mod:`clusterenv.worker.local_policy`. This module is where both modes are
loaded, so ``PolicyRunner(..., prefetch=k)`` finds either; it imports torch lazily.
"""

from __future__ import annotations

from clusterenv.learner.lockstep_rollouts import LockstepRunner
from clusterenv.learner.prefetched_rollouts import PrefetchingRunner
from clusterenv.learner.rollout_batch import RolloutBatch
from clusterenv.learner.runner_base import PolicyRunner, check_prefetch

__all__ = ["LockstepRunner", "PolicyRunner", "PrefetchingRunner", "RolloutBatch", "check_prefetch"]
