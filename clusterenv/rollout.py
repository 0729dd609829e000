"""Rollouts with policies on the workers: the worker-side handlers and the learner-side runner.

Protocol, per worker and per :meth:`PolicyRunner.rollout`::

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
(architecture once, weights as raw frames) travels with SET_POLICY when the runner is made.

Workers import torch only when a policy arrives; this module does not import it.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.async_vector_env import AsyncState

from clusterenv.env import ClusterEnv
from clusterenv.errors import PolicyError, ProtocolError
from clusterenv.heads import Categorical, Head, head_from_meta
from clusterenv.protocol import Kind, Message
from clusterenv.sync import EveryUpdate, SyncStrategy, Telemetry, WorkerTelemetry, mean_kl

if TYPE_CHECKING:
    import torch
    from torch import nn

    from clusterenv.policy import LocalPolicy
    from clusterenv.worker import Worker

__all__ = ["PolicyRunner", "RolloutBatch", "install"]

# The transition arrays of a ROLLOUT_RESULT, in frame order.
_FIELDS = ("obs", "actions", "logprobs", "logits", "rewards", "terminations", "truncations", "autoreset")


@dataclass
class RolloutBatch:
    """``T`` steps of every env, as numpy arrays (``as_tensors`` converts), in step-mode order.

    ``obs[t]`` is what the acting policy saw at step ``t``; ``actions[t]``, ``rewards[t]``,
    ``terminations[t]``, ``truncations[t]`` and ``infos[t]`` are exactly what
    ``envs.step(actions[t])`` would have returned from there, and ``obs[t + 1]`` (or
    ``next_obs`` after the last step) is the observation it returned. Env ``i`` is column
    ``i`` everywhere, as in step mode.

    NEXT_STEP autoreset (the default): the step after a done is a *reset step*, marked in
    ``autoreset[t]``: ``obs[t]`` is the last observation of the ended episode, the env
    ignored ``actions[t]`` and reset, ``rewards[t]`` is 0, both done flags are False and
    ``obs[t + 1]`` is the first observation of the new episode. Drop reset steps from the
    loss; a truncated step ``t`` bootstraps from ``obs[t + 1]``, its true last observation.
    In SAME_STEP mode ``autoreset`` is all False and last observations are in the infos.

    Attributes:
        obs: ``(T, N, *obs_shape)``, the observation dtype.
        actions: ``(T, N)`` int64.
        logprobs: ``(T, N)`` float32, log-probability of each action under the acting copy.
        logits: ``(T, N, A)`` float32, the acting copy's raw outputs (logits or Q-values).
        rewards: ``(T, N)`` float64.
        terminations: ``(T, N)`` bool.
        truncations: ``(T, N)`` bool.
        autoreset: ``(T, N)`` bool, True on NEXT_STEP reset steps.
        policy_versions: ``(T, N)`` int64, the learner version of the weights that acted.
        next_obs: ``(N, *obs_shape)``, the observation after the last step.
        infos: ``T`` step-mode info dicts (``episode`` statistics if the envs record them).
        learner_version: the latest published version when the rollout was asked for.
    """

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    logits: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    autoreset: np.ndarray
    policy_versions: np.ndarray
    next_obs: np.ndarray
    infos: list[dict[str, Any]] = field(repr=False)
    learner_version: int = 0

    @property
    def num_steps(self) -> int:
        """``T``."""
        return int(self.actions.shape[0])

    @property
    def num_envs(self) -> int:
        """``N``."""
        return int(self.actions.shape[1])

    def as_tensors(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Every array field as a torch tensor on ``device`` (same dtypes; bools stay bool)."""
        import torch

        return {
            f.name: torch.as_tensor(getattr(self, f.name), device=device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }

    def episodes(self) -> list[tuple[int, int, float, int]]:
        """``(step, env, return, length)`` of each episode that ended, from ``RecordEpisodeStatistics`` infos.

        Under SAME_STEP autoreset the statistics are read from ``infos[t]["final_info"]``.
        """
        ended = []
        for t, step_info in enumerate(self.infos):
            for info in (step_info, step_info.get("final_info", {})):
                if "_episode" not in info:
                    continue
                stats = info["episode"]
                for env in np.flatnonzero(info["_episode"]):
                    ended.append((t, int(env), float(stats["r"][env]), int(stats["l"][env])))
        return ended


# -- worker side ---------------------------------------------------------------------------
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

    def set_policy(self, msg: Message) -> tuple:
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
        return Kind.VALUE, {}, [], []

    def rollout(self, msg: Message) -> tuple:
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
            return Kind.WEIGHTS_REQUEST, {"kl": request["kl"], "version": self.policy.version}, [], []
        return self._act(request)

    def set_weights(self, msg: Message) -> tuple:
        if self.policy is None:
            raise PolicyError("SET_WEIGHTS before SET_POLICY: this worker holds no policy.")
        self.policy.load(list(msg.arrays), msg.meta["version"])
        request, self.pending = self.pending, None
        return (Kind.VALUE, {}, [], []) if request is None else self._act(request)

    def _act(self, request: dict[str, Any]) -> tuple:
        envs, policy = self.worker.envs, self.policy
        assert envs is not None and policy is not None
        steps, head, n = int(request["num_steps"]), request["head"], envs.num_envs
        next_step = envs.autoreset_mode == AutoresetMode.NEXT_STEP
        current = envs._observations
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
                out["autoreset"][t] = envs._autoreset_envs
            logits = policy.outputs(out["obs"][t])
            out["logits"][t] = logits
            actions, out["logprobs"][t] = head.act(logits, self.rngs)
            out["actions"][t] = actions + self.action_start
            current, out["rewards"][t], out["terminations"][t], out["truncations"][t], _ = envs.step(out["actions"][t])
            info_logs.append(envs.info_log)
            envs.info_log = []
        probe = min(int(request["probe_steps"]), steps)
        self.probe_outputs = out["logits"][steps - probe :].reshape(probe * n, -1).copy()
        arrays = [out[name] for name in _FIELDS] + [np.array(current)]
        blobs = [cloudpickle.dumps(info_logs) if any(info_logs) else b""]
        return Kind.ROLLOUT_RESULT, {"version": policy.version, "kl": request["kl"]}, arrays, blobs


def install(worker: Worker) -> None:
    """Register the local-policy commands on a worker (called by ``clusterenv.worker``)."""
    state = _WorkerPolicy(worker)
    worker.handlers[Kind.SET_POLICY] = state.set_policy
    worker.handlers[Kind.SET_WEIGHTS] = state.set_weights
    worker.handlers[Kind.ROLLOUT] = state.rollout


# -- learner side --------------------------------------------------------------------------
class PolicyRunner:
    """Collect rollouts with a local copy of ``policy`` in every worker of a :class:`ClusterEnv`.

    The runner ships the policy once, then each :meth:`rollout` asks every worker for
    ``num_steps`` steps of all its envs, and each worker first lets ``sync`` decide, from
    ``KL(π_learner ‖ π_local)`` on its own recent observations (see :mod:`clusterenv.sync`)
    or from the version lag, whether to pull the latest published weights. Plain
    ``envs.step(actions)`` keeps working on the same envs, between rollouts too: a rollout
    continues from wherever the envs are. One runner per env at a time: a new runner's
    policy replaces the old one's in the workers.

    Workers replaced after a failure (``on_worker_failure="restart"``) do not get the policy
    back: a rollout they were part of raises ``WorkerLostError``.

    Example:
        >>> import clusterenv, torch
        >>> envs = clusterenv.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"num_workers": 2})
        >>> actor = torch.nn.Linear(4, 2)
        >>> runner = clusterenv.PolicyRunner(envs, actor, clusterenv.APS(threshold=0.01), seed=0)
        >>> batch = runner.rollout(8)
        >>> batch.obs.shape, batch.logits.shape, batch.policy_versions.max()
        ((8, 4, 4), (8, 4, 2), np.int64(0))
        >>> runner.publish(actor)
        1
        >>> envs.close()
    """

    def __init__(
        self,
        envs: ClusterEnv,
        policy: nn.Module | Callable[[], nn.Module],
        sync: SyncStrategy | None = None,
        *,
        head: Head | None = None,
        seed: int | None = None,
        probe_steps: int = 16,
        measure_kl: bool = True,
        timeout: float | None = None,
    ) -> None:
        """Ship the policy (version 0) to every worker.

        Args:
            envs: the environments; their workers get the policy.
            policy: a ``torch.nn.Module`` mapping observations ``(B, *obs_shape)`` to outputs
                ``(B, A)`` (logits or Q-values), or a zero-argument callable returning one.
            sync: when workers pull new weights; default :class:`~clusterenv.sync.EveryUpdate`.
            head: how outputs become the acting distribution; default
                :class:`~clusterenv.heads.Categorical` (softmax). Use ``EpsilonGreedy`` for Q-values.
            seed: seeds each env's action-sampling generator as ``default_rng([seed, env_index])``,
                and ``envs.reset(seed=seed)`` if the envs were never reset.
            probe_steps: how many of a worker's latest steps (times its envs) the KL is measured on.
            measure_kl: also measure the KL for strategies that do not need it (for telemetry).
            timeout: seconds a rollout may take per call; default ``envs.timeout``.
        """
        from torch import nn

        from clusterenv.policy import LocalPolicy, pack_architecture, snapshot_weights, validate_policy

        if not isinstance(envs, ClusterEnv):
            raise TypeError(f"`envs` must be a ClusterEnv, whose workers can hold a policy, got {type(envs).__name__}.")
        if envs.autoreset_mode == AutoresetMode.DISABLED:
            raise PolicyError(
                "Rollouts need the envs to reset themselves: use autoreset_mode NEXT_STEP or SAME_STEP, not DISABLED."
            )
        if not isinstance(policy, nn.Module) and callable(policy):
            policy = policy()
        if not isinstance(policy, nn.Module):
            raise PolicyError(
                f"`policy` must be a torch.nn.Module (or a zero-argument callable returning one), got {type(policy).__name__}."
            )
        sync = EveryUpdate() if sync is None else sync
        if not isinstance(sync, SyncStrategy):
            raise PolicyError(f"`sync` must be a SyncStrategy such as APS(threshold=0.01), got {sync!r}.")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 1:
            raise PolicyError(f"`probe_steps` must be a positive integer, got {probe_steps!r}.")
        self.envs, self.sync, self.seed = envs, sync, seed
        self.head: Head = Categorical() if head is None else head
        self.probe_steps = probe_steps
        self.send_probes = measure_kl or sync.needs_kl
        self.timeout = timeout
        self._policy = policy
        self._architecture = pack_architecture(policy)
        self._names, self._weights = snapshot_weights(policy)
        self._learner: LocalPolicy = LocalPolicy(self._architecture, self._names, self._weights, version=0)
        validate_policy(self._learner.module, envs.single_observation_space, envs.single_action_space)
        self._version = 0
        self._probe_obs: list[np.ndarray | None] = [None] * envs.num_workers
        self._telemetry = Telemetry([WorkerTelemetry(w) for w in range(envs.num_workers)])
        self._ship(cloudpickle.dumps(sync))

    # -- shipping --------------------------------------------------------------------------
    def _ship(self, strategy: bytes) -> None:
        envs = self.envs
        meta = {"names": self._names, "version": self._version, "seed": self.seed}
        size = len(self._architecture) + sum(a.nbytes for a in self._weights)
        self._call(lambda w: envs._send(w, Kind.SET_POLICY, meta, self._weights, [self._architecture, strategy]))
        for record in self._telemetry.workers:
            record.initial_bytes += size

    def _call(self, send: Callable[[int], None], on_request: Callable[[int, Message], bool] | None = None) -> dict:
        """Send one command to every worker and gather the replies, as one pending call of the env."""
        envs = self.envs
        envs._begin(AsyncState.WAITING_CALL)
        envs._state = AsyncState.WAITING_CALL
        try:
            for w in range(envs.num_workers):
                send(w)
            timeout = envs.timeout if self.timeout is None else self.timeout
            return envs._gather(range(envs.num_workers), "running the local policies", timeout, on_request)
        finally:
            envs._state = AsyncState.DEFAULT

    def publish(self, policy: nn.Module | None = None) -> int:
        """Make the current weights of ``policy`` (default: the one given) the learner's next version.

        Sends nothing: it snapshots the weights (so later training does not change this
        version) for workers to pull when their strategy says so.

        Returns:
            The new learner version.
        """
        from clusterenv.policy import snapshot_weights

        names, weights = snapshot_weights(self._policy if policy is None else policy)
        if names != self._names:
            raise PolicyError(
                f"The published policy has tensors {names[:6]}..., but the shipped one has {self._names[:6]}...; "
                "publish a module with the same architecture."
            )
        for name, new, old in zip(names, weights, self._weights, strict=True):
            if (new.shape, new.dtype) != (old.shape, old.dtype):
                raise PolicyError(
                    f"The published tensor `{name}` has shape {new.shape} and dtype {new.dtype}, but the shipped one "
                    f"has {old.shape} and {old.dtype}; publish a module with the same architecture."
                )
        self._version += 1
        self._weights = weights
        self._learner.load(weights, self._version)
        return self._version

    @property
    def version(self) -> int:
        """The latest published learner version (0: the weights shipped with the policy)."""
        return self._version

    @property
    def telemetry(self) -> Telemetry:
        """A snapshot of the per-worker and total sync telemetry."""
        snapshot = copy.deepcopy(self._telemetry)
        snapshot.learner_version = self._version
        return snapshot

    # -- rollouts --------------------------------------------------------------------------
    def rollout(self, num_steps: int, *, head: Head | None = None) -> RolloutBatch:
        """Run ``num_steps`` steps of every env with the workers' local policies.

        Args:
            num_steps: ``T``, steps per env.
            head: the acting head for this rollout (e.g. ``EpsilonGreedy`` with the current epsilon);
                default ``self.head``.

        Returns:
            The transitions, see :class:`RolloutBatch`.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"`num_steps` must be a positive integer, got {num_steps!r}.")
        envs = self.envs
        if envs._needs_reset:
            envs.reset(seed=self.seed)
        head = self.head if head is None else head
        outputs = self._probe_outputs() if self.send_probes else [None] * envs.num_workers
        meta = {
            "num_steps": num_steps,
            "learner_version": self._version,
            "head": head.to_meta(),
            "probe_steps": self.probe_steps,
        }

        def send(w: int) -> None:
            probe = outputs[w]
            envs._send(w, Kind.ROLLOUT, meta, [] if probe is None else [probe])
            if probe is not None:
                self._telemetry.workers[w].probe_bytes += probe.nbytes

        return self._assemble(self._call(send, self._answer_pull), num_steps)

    def _probe_outputs(self) -> list[np.ndarray | None]:
        """The latest version's outputs on each worker's probe states, in one forward pass."""
        present = [obs for obs in self._probe_obs if obs is not None]
        if not present:
            return [None] * len(self._probe_obs)
        flat = self._learner.outputs(np.concatenate(present))
        result: list[np.ndarray | None] = []
        start = 0
        for obs in self._probe_obs:
            if obs is None:
                result.append(None)
            else:
                result.append(flat[start : start + len(obs)])
                start += len(obs)
        return result

    def _answer_pull(self, worker_id: int, msg: Message) -> bool:
        if msg.kind is not Kind.WEIGHTS_REQUEST:
            return False
        self.envs._send(worker_id, Kind.SET_WEIGHTS, {"version": self._version}, self._weights)
        record = self._telemetry.workers[worker_id]
        record.pulls += 1
        record.weight_bytes += sum(a.nbytes for a in self._weights)
        return True

    def _assemble(self, replies: dict[int, Message], steps: int) -> RolloutBatch:
        envs = self.envs
        parts: dict[str, list[np.ndarray]] = {name: [] for name in (*_FIELDS, "policy_versions", "next_obs")}
        logs: list[tuple[int, list[list[tuple[int, dict[str, Any]]]]]] = []
        for w in range(envs.num_workers):
            msg, sl = replies[w], envs._slices[w]
            if msg.kind is not Kind.ROLLOUT_RESULT or len(msg.arrays) != len(_FIELDS) + 1:
                raise ProtocolError(f"Worker {w} answered a rollout with {msg.kind.name} and {len(msg.arrays)} arrays.")
            for name, array in zip(_FIELDS, msg.arrays, strict=False):
                parts[name].append(array)
            parts["next_obs"].append(msg.arrays[-1])
            version = int(msg.meta["version"])
            parts["policy_versions"].append(np.full((steps, sl.stop - sl.start), version, dtype=np.int64))
            record = self._telemetry.workers[w]
            record.lag_counts[self._version - version] += steps * (sl.stop - sl.start)
            if msg.meta.get("kl") is not None:
                record.record_kl(float(msg.meta["kl"]))
            probe = min(self.probe_steps, steps)
            obs = msg.arrays[0]
            self._probe_obs[w] = obs[steps - probe :].reshape(probe * obs.shape[1], *obs.shape[2:]).copy()
            if msg.blobs[0]:
                logs.append((sl.start, pickle.loads(msg.blobs[0])))
        infos: list[dict[str, Any]] = []
        for t in range(steps):
            info: dict[str, Any] = {}
            for start, worker_logs in logs:
                for local_index, env_info in worker_logs[t]:
                    info = envs._add_info(info, env_info, start + local_index)
            infos.append(info)
        arrays = {name: np.concatenate(values, axis=0 if name == "next_obs" else 1) for name, values in parts.items()}
        return RolloutBatch(**arrays, infos=infos, learner_version=self._version)
