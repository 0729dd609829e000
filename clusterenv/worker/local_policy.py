"""The local-policy commands of a worker: SET_POLICY, SET_WEIGHTS and ROLLOUT.

Protocol, per worker and per rollout (the learner's side is
:class:`clusterenv.learner.rollouts.PolicyRunner`)::

    learner                                        worker
    ROLLOUT(num_steps, learner_version, head,  →   KL(π_learner ‖ π_local) on its probe states
            learner outputs on the worker's        strategy.should_pull(...)?
            probe states)                          ├─ no:  act num_steps steps
                                               ←   │       ROLLOUT_RESULT(transitions, version, kl)
                                               ←   └─ yes: WEIGHTS_REQUEST(kl)
    SET_WEIGHTS(version, weight arrays)        →          load, then act num_steps steps
                                               ←          ROLLOUT_RESULT(transitions, version, kl)

so a pull costs one extra round trip, only when it happens. The probe states are the
observations of the worker's last ``probe_steps`` steps (per leaf, for ``Dict``/``Tuple``
observation spaces): the learner has just received
them in the previous ROLLOUT_RESULT and the worker kept its own outputs on them, so only
the learner's small ``(states, actions)`` output array travels. The policy itself
(architecture once, weights as raw frames) travels with SET_POLICY.

This module is worker-side: it imports torch only when a policy arrives, and nothing of the learner.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np
from gymnasium.vector import AutoresetMode

from clusterenv.errors import PolicyError
from clusterenv.policy.heads import Head, head_from_meta
from clusterenv.policy.strategies import EveryUpdate, PullReason, SyncStrategy, mean_kl, probe_rows, state_kls
from clusterenv.wire.infos import pack_infos
from clusterenv.wire.leaves import is_array_tree, leaf_arrays, unflatten
from clusterenv.wire.messages import (
    ProbeMeta,
    RolloutAheadMeta,
    RolloutMeta,
    RolloutResultMeta,
    SetPolicyMeta,
    WeightsMeta,
    WeightsRequestMeta,
    meta_of,
)
from clusterenv.wire.protocol import Kind, Message, rollout_frames

if TYPE_CHECKING:
    from clusterenv.policy.shipping import LocalPolicy
    from clusterenv.worker.commands import Worker

__all__ = ["RolloutAborted", "install"]

logger = logging.getLogger(__name__)


class RolloutAborted(Exception):
    """The learner asked this worker to close in the middle of a prefetched rollout."""


class _WorkerPolicy:
    """The local policy copy of one worker and the handlers that use it."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.policy: LocalPolicy | None = None
        self.strategy: SyncStrategy = EveryUpdate()
        self.rngs: list[np.random.Generator] = []
        self.probe_outputs: np.ndarray | None = None
        self.pending: dict[str, Any] | None = None
        # Prefetch mode: the probe states of recent rollouts by id (an array, or a dict/tuple tree of
        # them), the learner's latest outputs on one of them, and whether a pull is on its way.
        self.probe_obs: dict[int, Any] = {}
        self.learner_probe: tuple[int, int, np.ndarray, float | None] | None = None
        # The outstanding pull's call number, flags and reason (None: no pull on its way): a pull sent in a
        # call the learner has since ended (its runner's stop()) was dropped there, and is asked again.
        self.asked: tuple[Any, bool, bool, PullReason] | None = None
        # The digest of the weights held (the base a delta names); the last rollout's probe states
        # (lockstep), and a lossy version whose guard still waits for the learner's outputs (prefetch).
        self.digest: bytes | None = None
        self.probe_states: Any = None
        self.head: Head | None = None
        self.unguarded: tuple[int, float] | None = None

    def set_policy(self, msg: Message) -> Message:
        import torch

        from clusterenv.policy.shipping import LocalPolicy

        # The workers are the parallelism: more threads per worker only oversubscribe cores.
        torch.set_num_threads(1)
        envs = self.worker.envs
        assert envs is not None
        if not is_array_tree(envs.single_observation_space):  # the learner refuses these before shipping
            raise PolicyError(f"Local policies cannot take observations of space {envs.single_observation_space}.")
        meta = meta_of(msg, SetPolicyMeta)
        self.policy = LocalPolicy(msg.blobs[0], meta["names"], list(msg.arrays), version=meta["version"])
        self.strategy = pickle.loads(msg.blobs[1])
        seed = meta["seed"]
        # One generator per env, keyed by its global index: samples do not depend on the worker split.
        offset = self.worker.env_offset
        self.rngs = [np.random.default_rng(None if seed is None else [seed, offset + i]) for i in range(envs.num_envs)]
        self.probe_outputs, self.pending = None, None
        self.probe_obs, self.learner_probe, self.asked = {}, None, None
        self.digest, self.probe_states, self.head, self.unguarded = meta["digest"], None, None, None
        return Message(Kind.VALUE)

    def rollout(self, msg: Message) -> Message:
        """A lockstep rollout: check the KL, pull and wait for the weights if the strategy says so, act."""
        if self.policy is None:
            raise PolicyError("ROLLOUT before SET_POLICY: this worker holds no policy.")
        meta = meta_of(msg, RolloutMeta)
        request: dict[str, Any] = {**meta, "head": head_from_meta(meta["head"]), "kl": None}
        request["learner_outputs"] = msg.arrays[0] if msg.arrays else None
        divergence = None
        if msg.arrays and self.probe_outputs is not None:
            request["kl"], divergence = self._measure(request["head"], msg.arrays[0], self.probe_outputs)
        if self._should_pull(meta["learner_version"], divergence, meta.get("movement")):
            self.pending = request
            return self._request(request["kl"], reason=self._reason(divergence, meta.get("movement")))
        return self._act(request)

    def _measure(self, head: Head, learner_outputs: np.ndarray, local_outputs: np.ndarray) -> tuple[float, float]:
        """The mean KL over the probe states (reported), and the strategy's statistic of them (decided on)."""
        per_state = state_kls(head, learner_outputs, local_outputs)
        return float(np.mean(per_state)), self.strategy.divergence(per_state)

    def _reason(self, kl: float | None, movement: float | None) -> PullReason:
        """Why the strategy pulls, judged on what it decided with (no movement for one that does not take it)."""
        return self.strategy.reason(kl, movement=movement if self.strategy.needs_movement else None)

    def _should_pull(self, learner_version: int, kl: float | None, movement: float | None) -> bool:
        """The strategy's answer; the learner's movement goes only to a strategy that takes it."""
        assert self.policy is not None
        local_version = self.policy.version
        if self.strategy.needs_movement:
            return self.strategy.should_pull(  # type: ignore[call-arg]
                local_version=local_version, learner_version=learner_version, kl=kl, movement=movement
            )
        return self.strategy.should_pull(local_version=local_version, learner_version=learner_version, kl=kl)

    @property
    def pull_outstanding(self) -> bool:
        """Prefetch mode: a pull was sent and its answer has not been loaded yet."""
        return self.asked is not None

    def _ask(self, kl: float | None, reason: PullReason, *, held: bool = True, exact: bool = False) -> None:
        """Prefetch mode: send a pull without waiting for it (the answer is a PUSH_WEIGHTS, taken between steps)."""
        self.asked = (self.worker.mailbox.seq, held, exact, reason)
        self.worker.send(self._request(kl, reason=reason, held=held, exact=exact))

    def _request(self, kl: float | None, *, reason: PullReason, held: bool = True, exact: bool = False) -> Message:
        """A WEIGHTS_REQUEST; ``held=False`` when the weights held cannot be a delta's base (ask for a full copy)."""
        assert self.policy is not None
        held_digest = self.digest if held else None
        meta = WeightsRequestMeta(
            kl=kl, version=self.policy.version, held=held_digest, exact=exact, reason=reason.value
        )
        return Message(Kind.WEIGHTS_REQUEST, meta)

    def rollout_ahead(self, msg: Message) -> Message:
        """A rollout of a prefetching runner: check the KL, ask for weights without waiting, act."""
        if self.policy is None:
            raise PolicyError("ROLLOUT_AHEAD before SET_POLICY: this worker holds no policy.")
        meta = meta_of(msg, RolloutAheadMeta)
        request: dict[str, Any] = {**meta, "head": head_from_meta(meta["head"]), "kl": None}
        mailbox = self.worker.mailbox
        mailbox.poll()  # the latest probe outputs and any weights that came while this rollout was queued
        learner_version, movement, divergence = int(request["learner_version"]), None, None
        if self.learner_probe is not None and self.learner_probe[0] in self.probe_obs:
            rollout_id, version, outputs, movement = self.learner_probe
            learner_version = max(learner_version, version)
            # The same states on both sides: the learner's latest outputs against this copy's outputs now.
            local = self.policy.outputs(self.probe_obs[rollout_id])
            request["kl"], divergence = self._measure(request["head"], outputs, local)
        pull = self._should_pull(learner_version, divergence, movement)
        self.head = request["head"]
        if self.asked is not None and self.asked[0] != mailbox.seq:
            _, held, exact, reason = self.asked
            self._ask(request["kl"], reason, held=held, exact=exact)
        if pull and not self.pull_outstanding:
            self._ask(request["kl"], self._reason(divergence, movement))
        reply = self._act(request, between_steps=mailbox.poll)
        rollout_id = int(request["rollout_id"])
        self.probe_obs[rollout_id] = self.probe_states  # this rollout's probe states, as _act kept them
        for old in [r for r in self.probe_obs if r < rollout_id - int(request["keep_probes"])]:
            del self.probe_obs[old]
        return Message(reply.kind, {**reply.meta, "rollout_id": rollout_id}, reply.arrays, reply.blobs)

    def probe(self, msg: Message) -> None:
        """The learner's latest outputs on the probe states of one of this worker's rollouts (prefetch mode)."""
        meta = meta_of(msg, ProbeMeta)
        self.learner_probe = (int(meta["rollout_id"]), int(meta["version"]), msg.arrays[0], meta.get("movement"))
        self._check_pushed()

    def set_weights(self, msg: Message) -> Message:
        """The answer to a lockstep pull (or a publish): load the weights, then act the pending rollout, if any.

        A delta this worker cannot take, or a lossy one that moves the policy past its guard,
        is answered with another WEIGHTS_REQUEST, and the rollout waits for that answer.
        """
        if self.policy is None:
            raise PolicyError("SET_WEIGHTS before SET_POLICY: this worker holds no policy.")
        meta = meta_of(msg, WeightsMeta)
        request = self.pending
        if not self._take(msg):
            return self._request(None if request is None else request["kl"], reason=PullReason.REPAIR, held=False)
        if request is not None and "guard_kl" in meta and request["learner_outputs"] is not None:
            if meta["version"] == request["learner_version"] and self.probe_states is not None:
                kl = mean_kl(request["head"], request["learner_outputs"], self.policy.outputs(self.probe_states))
                if kl > meta["guard_kl"]:
                    return self._request(request["kl"], reason=PullReason.REPAIR, exact=True)
        self.pending = None
        return Message(Kind.VALUE) if request is None else self._act(request)

    def push_weights(self, msg: Message) -> None:
        """The answer to a prefetching worker's pull, taken between two steps: the next step acts with it.

        A lossy delta is checked once the learner's outputs at its version are here (they may
        come after it); until then the rebuilt copy acts.
        """
        if self.policy is None:
            raise PolicyError("PUSH_WEIGHTS before SET_POLICY: this worker holds no policy.")
        meta = meta_of(msg, WeightsMeta)
        if not self._take(msg):
            self._ask(None, PullReason.REPAIR, held=False)
            return
        self.asked = None
        self.unguarded = (meta["version"], meta["guard_kl"]) if "guard_kl" in meta else None
        self._check_pushed()

    def _take(self, msg: Message) -> bool:
        """Load the weights a SET_WEIGHTS or PUSH_WEIGHTS carries; False if they are a delta from other weights.

        A delta is rebuilt from the held weights (:func:`~clusterenv.policy.deltas.apply_delta`)
        and must give the digest the learner names; otherwise nothing is loaded.
        """
        from clusterenv.policy.deltas import apply_delta, digest

        policy = self.policy
        assert policy is not None
        meta = meta_of(msg, WeightsMeta)
        arrays = list(msg.arrays)
        if meta["encoding"] != "full":
            if meta["base"] != self.digest:
                logger.warning("A weight delta names other weights than this worker holds; asking for a full copy.")
                return False
            arrays = apply_delta(policy.arrays(), arrays, meta.get("scales", []), meta.get("bits"))
            if digest(arrays) != meta["digest"]:
                logger.warning("A weight delta did not rebuild the weights it names; asking for a full copy.")
                return False
        policy.load(arrays, meta["version"])
        self.digest = meta["digest"]
        return True

    def _check_pushed(self) -> None:
        """Prefetch mode: check a pushed lossy delta once the learner's outputs at its version are here."""
        if self.unguarded is None or self.learner_probe is None or self.head is None:
            return
        version, guard_kl = self.unguarded
        rollout_id, probe_version, outputs, _ = self.learner_probe
        if probe_version != version or rollout_id not in self.probe_obs:
            return
        assert self.policy is not None
        self.unguarded = None
        if mean_kl(self.head, outputs, self.policy.outputs(self.probe_obs[rollout_id])) > guard_kl:
            self._ask(None, PullReason.REPAIR, exact=True)

    def _act(self, request: dict[str, Any], between_steps: Callable[[], None] | None = None) -> Message:
        """Act ``num_steps`` steps; the ROLLOUT_RESULT.

        Keeps the rollout's probe states and this copy's outputs on them, for the next KL check.
        """
        envs, policy, worker = self.worker.envs, self.policy, self.worker
        assert envs is not None and policy is not None
        steps, head, n = int(request["num_steps"]), request["head"], envs.num_envs
        restarted = worker.never_reset
        if restarted:  # a replacement for a lost worker, asked to replay the rollout: start new episodes
            envs.reset()
            envs.info_log = []
            worker.never_reset = False
        next_step = envs.autoreset_mode == AutoresetMode.NEXT_STEP
        space = envs.single_observation_space
        current = envs.current_observations
        # One rollout buffer per observation leaf, written straight from the env's batch each step. A
        # single array space (the common case) is one leaf and takes no tree walk per step.
        single = isinstance(current, np.ndarray)
        obs = [
            np.empty((steps, *leaf.shape), dtype=leaf.dtype)
            for leaf in ([current] if single else leaf_arrays(space, current))
        ]
        # What the policy sees at each step: views of those buffers, in the space's structure.
        inputs = obs[0] if single else [unflatten(space, [leaf[t] for leaf in obs]) for t in range(steps)]
        out: dict[str, np.ndarray] = {
            "logprobs": np.empty((steps, n), dtype=np.float32),
            "rewards": np.empty((steps, n), dtype=np.float64),
            "terminations": np.empty((steps, n), dtype=np.bool_),
            "truncations": np.empty((steps, n), dtype=np.bool_),
            "autoreset": np.zeros((steps, n), dtype=np.bool_),
            "policy_versions": np.empty((steps, n), dtype=np.int64),
        }
        info_logs = []
        for t in range(steps):
            if between_steps is not None:
                between_steps()  # weights that arrived act from this step on; a CLOSE aborts
                if worker.mailbox.closing:
                    raise RolloutAborted
            # Copy: with copy=False the env writes its next observation into this same buffer.
            if single:
                obs[0][t] = current
            else:
                for buffer, leaf in zip(obs, leaf_arrays(space, current), strict=True):
                    buffer[t] = leaf
            if next_step:
                out["autoreset"][t] = envs.autoresetting()
            logits = policy.outputs(inputs[t])
            actions, out["logprobs"][t] = head.act(logits, self.rngs)
            if t == 0:  # shapes and dtypes come from the head: (n, *action_shape)
                out["logits"] = np.empty((steps, *logits.shape), dtype=np.float32)
                out["actions"] = np.empty((steps, *actions.shape), dtype=actions.dtype)
            out["logits"][t], out["actions"][t] = logits, actions
            out["policy_versions"][t] = policy.version
            env_actions = head.to_env(actions, envs.single_action_space)
            current, out["rewards"][t], out["terminations"][t], out["truncations"][t], _ = envs.step(env_actions)
            info_logs.append(envs.info_log)
            envs.info_log = []
        self.probe_outputs = probe_rows([out["logits"]], int(request["probe_steps"]))[0]
        self.probe_states = unflatten(space, probe_rows(obs, int(request["probe_steps"])))
        next_obs = [np.array(current)] if single else [np.array(leaf) for leaf in leaf_arrays(space, current)]
        blobs = [cloudpickle.dumps([pack_infos(log, envs.num_envs) for log in info_logs]) if any(info_logs) else b""]
        meta = RolloutResultMeta(version=policy.version, kl=request["kl"], restarted=restarted)
        if (usage := envs.step_clock.report()) is not None:  # once a second at most
            meta["usage"] = usage
        return Message(Kind.ROLLOUT_RESULT, meta, rollout_frames(obs, out, next_obs), blobs)


def install(worker: Worker) -> None:
    """Register the local-policy commands on a worker (called by ``clusterenv.worker.process``)."""
    state = _WorkerPolicy(worker)
    worker.handlers[Kind.SET_POLICY] = state.set_policy
    worker.handlers[Kind.SET_WEIGHTS] = state.set_weights
    worker.handlers[Kind.PUSH_WEIGHTS] = state.push_weights
    worker.handlers[Kind.ROLLOUT] = state.rollout
    worker.handlers[Kind.ROLLOUT_AHEAD] = state.rollout_ahead
    worker.handlers[Kind.PROBE] = state.probe
    worker.urgent.update({Kind.PROBE, Kind.PUSH_WEIGHTS})
