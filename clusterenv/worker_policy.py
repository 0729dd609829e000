"""The local-policy commands of a worker: SET_POLICY, SET_WEIGHTS and ROLLOUT.

Protocol, per worker and per rollout (the learner's side is
:class:`clusterenv.rollout.PolicyRunner`)::

    learner                                        worker
    ROLLOUT(num_steps, learner_version, head,  →   KL(π_learner ‖ π_local) on its probe states
            learner outputs on the worker's        strategy.should_pull(...)?
            probe states)                          ├─ no:  act num_steps steps
                                               ←   │       ROLLOUT_RESULT(transitions, version, kl)
                                               ←   └─ yes: WEIGHTS_REQUEST(kl)
    SET_WEIGHTS(version, weight arrays)        →          load, then act num_steps steps
                                               ←          ROLLOUT_RESULT(transitions, version, kl)

so a pull costs one extra round trip, only when it happens. The probe states are the
observations of the worker's last ``probe_steps`` steps: the learner has just received
them in the previous ROLLOUT_RESULT and the worker kept its own outputs on them, so only
the learner's small ``(states, actions)`` output array travels. The policy itself
(architecture once, weights as raw frames) travels with SET_POLICY.

This module is worker-side: it imports torch only when a policy arrives, and nothing of the learner.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np
from gymnasium.vector import AutoresetMode

from clusterenv.errors import PolicyError
from clusterenv.heads import head_from_meta
from clusterenv.protocol import ROLLOUT_FIELDS, Kind, Message
from clusterenv.sync import EveryUpdate, SyncStrategy, mean_kl

if TYPE_CHECKING:
    from clusterenv.policy import LocalPolicy
    from clusterenv.worker import Worker

__all__ = ["install"]


class _WorkerPolicy:
    """The local policy copy of one worker and the handlers that use it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.policy: LocalPolicy | None = None
        self.strategy: SyncStrategy = EveryUpdate()
        self.rngs: list[np.random.Generator] = []
        self.action_start = 0
        self.probe_outputs: np.ndarray | None = None
        self.pending: dict[str, Any] | None = None

    def set_policy(self, msg: Message) -> Message:
        import torch

        from clusterenv.policy import LocalPolicy

        # The workers are the parallelism: more threads per worker only oversubscribe cores.
        torch.set_num_threads(1)
        envs = self.worker.envs
        assert envs is not None
        self.policy = LocalPolicy(msg.blobs[0], msg.meta["names"], list(msg.arrays), version=msg.meta["version"])
        self.strategy = pickle.loads(msg.blobs[1])
        seed = msg.meta["seed"]
        # One generator per env, keyed by its global index: samples do not depend on the worker split.
        offset = self.worker.env_offset
        self.rngs = [np.random.default_rng(None if seed is None else [seed, offset + i]) for i in range(envs.num_envs)]
        self.action_start = int(envs.single_action_space.start)  # type: ignore[attr-defined]
        self.probe_outputs = None
        self.pending = None
        return Message(Kind.VALUE)

    def rollout(self, msg: Message) -> Message:
        if self.policy is None:
            raise PolicyError("ROLLOUT before SET_POLICY: this worker holds no policy.")
        request = dict(msg.meta, head=head_from_meta(msg.meta["head"]), kl=None)
        if msg.arrays and self.probe_outputs is not None:
            request["kl"] = mean_kl(request["head"], msg.arrays[0], self.probe_outputs)
        pull = self.strategy.should_pull(
            local_version=self.policy.version, learner_version=msg.meta["learner_version"], kl=request["kl"]
        )
        if pull:
            self.pending = request
            return Message(Kind.WEIGHTS_REQUEST, {"kl": request["kl"], "version": self.policy.version})
        return self._act(request)

    def set_weights(self, msg: Message) -> Message:
        if self.policy is None:
            raise PolicyError("SET_WEIGHTS before SET_POLICY: this worker holds no policy.")
        self.policy.load(list(msg.arrays), msg.meta["version"])
        request, self.pending = self.pending, None
        return Message(Kind.VALUE) if request is None else self._act(request)

    def _act(self, request: dict[str, Any]) -> Message:
        envs, policy = self.worker.envs, self.policy
        assert envs is not None and policy is not None
        steps, head, n = int(request["num_steps"]), request["head"], envs.num_envs
        restarted = self.worker.never_reset
        if restarted:  # a replacement for a lost worker, asked to replay the rollout: start new episodes
            envs.reset()
            envs.info_log = []
            self.worker.never_reset = False
        next_step = envs.autoreset_mode == AutoresetMode.NEXT_STEP
        current = envs.current_observations
        num_actions = int(envs.single_action_space.n)  # type: ignore[attr-defined]
        out: dict[str, np.ndarray] = {
            "obs": np.empty((steps, *current.shape), dtype=current.dtype),
            "actions": np.empty((steps, n), dtype=np.int64),
            "logprobs": np.empty((steps, n), dtype=np.float32),
            "logits": np.empty((steps, n, num_actions), dtype=np.float32),
            "rewards": np.empty((steps, n), dtype=np.float64),
            "terminations": np.empty((steps, n), dtype=np.bool_),
            "truncations": np.empty((steps, n), dtype=np.bool_),
            "autoreset": np.zeros((steps, n), dtype=np.bool_),
        }
        info_logs = []
        for t in range(steps):
            # Copy: with copy=False the env writes its next observation into this same buffer.
            out["obs"][t] = current
            if next_step:
                out["autoreset"][t] = envs.autoresetting()
            logits = policy.outputs(out["obs"][t])
            out["logits"][t] = logits
            actions, out["logprobs"][t] = head.act(logits, np.array([rng.random() for rng in self.rngs]))
            out["actions"][t] = actions + self.action_start
            current, out["rewards"][t], out["terminations"][t], out["truncations"][t], _ = envs.step(out["actions"][t])
            info_logs.append(envs.info_log)
            envs.info_log = []
        probe = min(int(request["probe_steps"]), steps)
        self.probe_outputs = out["logits"][steps - probe :].reshape(probe * n, -1).copy()
        arrays = [out[name] for name in ROLLOUT_FIELDS] + [np.array(current)]
        blobs = [cloudpickle.dumps(info_logs) if any(info_logs) else b""]
        meta = {"version": policy.version, "kl": request["kl"], "restarted": restarted}
        return Message(Kind.ROLLOUT_RESULT, meta, arrays, blobs)


def install(worker: Worker) -> None:
    """Register the local-policy commands on a worker (called by ``clusterenv.worker``)."""
    state = _WorkerPolicy(worker)
    worker.handlers[Kind.SET_POLICY] = state.set_policy
    worker.handlers[Kind.SET_WEIGHTS] = state.set_weights
    worker.handlers[Kind.ROLLOUT] = state.rollout
