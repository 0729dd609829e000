"""Lockstep rollouts: each :meth:`LockstepRunner.rollout` asks every worker for ``T`` steps and waits.

The workers idle while the learner trains, and plain ``envs.step(actions)`` keeps working
between rollouts: a rollout continues from wherever the envs are. A worker lost during a
rollout is replaced, gets the policy again (the restart hook), and runs the rollout anew
on its fresh envs (the command is replayed).
"""

from __future__ import annotations

from clusterenv.learner.pool import OnLoss
from clusterenv.learner.rollout_batch import RolloutBatch
from clusterenv.learner.runner_base import PolicyRunner
from clusterenv.policy.heads import Head
from clusterenv.wire.messages import RolloutMeta
from clusterenv.wire.protocol import Kind

__all__ = ["LockstepRunner"]


class LockstepRunner(PolicyRunner, prefetching=False):
    """The :class:`~clusterenv.learner.rollouts.PolicyRunner` of ``prefetch=0``."""

    def _published(self) -> None:
        """Nothing to tell the workers now: each learns of the new version when its next rollout starts."""

    def rollout(self, num_steps: int, *, head: Head | None = None) -> RolloutBatch:
        """Every env steps ``num_steps`` times now, while the learner waits (see :meth:`PolicyRunner.rollout`)."""
        self._check_steps(num_steps)
        head = self.head if head is None else head
        envs = self.envs
        if envs.needs_reset:
            envs.reset(seed=self.seed)
        outputs = self._probe_outputs(head) if self.send_probes else [None] * envs.num_workers
        meta = RolloutMeta(
            num_steps=num_steps, learner_version=self._version, head=head.to_meta(), probe_steps=self.probe_steps
        )
        with envs.pending_call() as pool:
            envs.note_cuts_reported(range(pool.num_workers))  # a moved worker's rollout starts new episodes, flagged
            for w, probe in enumerate(outputs):
                # A replacement gets the policy again (the restart hook), then this rollout on its fresh envs.
                worker_meta = RolloutMeta(**meta)
                if (movement := self._movement_of(w)) is not None:
                    worker_meta["movement"] = movement
                pool.send(w, Kind.ROLLOUT, worker_meta, [] if probe is None else [probe], on_loss=OnLoss.REPLAY)
                if probe is not None:
                    self._telemetry.workers[w].probe_bytes += probe.nbytes
            replies = pool.gather(
                range(pool.num_workers), "running the local policies", self._timeout(), self._answer_pull
            )
        return self._assemble(replies, num_steps)
