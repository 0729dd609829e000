"""The shared base of both rollout modes: :class:`PolicyRunner` and what every mode does alike.

Shipping the policy, publishing versions, the learner's outputs on the probe states, answering
pulls and assembling batches live here; each mode (lockstep, prefetching) is a subclass in a
module of its own that names its mode in its class statement, so that ``PolicyRunner(...,
prefetch=k)`` can return the right one without this module importing the modes (which import
it). :mod:`clusterenv.learner.rollouts` imports all of them, and is where the public name comes
from. This module imports torch lazily.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import cloudpickle
import numpy as np
from gymnasium.vector import AutoresetMode

from clusterenv.errors import PolicyError, ProtocolError
from clusterenv.learner.movement import LearnerMovement
from clusterenv.learner.pool import FollowUp, OnLoss, WorkerPool, weak_callback
from clusterenv.learner.rollout_batch import RolloutBatch
from clusterenv.learner.step_buffers import restarted_records
from clusterenv.learner.vector_env import ClusterEnv
from clusterenv.learner.weight_shipments import WeightShipments
from clusterenv.policy.deltas import LossyWeights, check_weights_spec
from clusterenv.policy.heads import Head, default_head
from clusterenv.policy.strategies import EveryUpdate, SyncStrategy, Telemetry, WorkerTelemetry, probe_rows
from clusterenv.wire.infos import InfoPayload, InfoRecord, merge_infos, replay_infos
from clusterenv.wire.leaves import leaf_specs, unflatten
from clusterenv.wire.messages import RolloutResultMeta, SetPolicyMeta, WeightsRequestMeta, meta_of
from clusterenv.wire.protocol import ROLLOUT_FIELDS, Kind, Message, split_rollout_frames

if TYPE_CHECKING:
    import torch
    from torch import nn

    from clusterenv.policy.shipping import LocalPolicy

__all__ = ["PolicyRunner", "check_prefetch"]


def check_prefetch(prefetch: Any) -> int:
    """``prefetch`` if it is a non-negative integer (0: lockstep), else :class:`PolicyError`."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise PolicyError(f"`prefetch` must be a non-negative integer (0: lockstep), got {prefetch!r}.")
    return prefetch


class PolicyRunner(abc.ABC):
    """Collect rollouts with a local copy of ``policy`` in every worker of a :class:`ClusterEnv`.

    The runner ships the policy once, then each :meth:`rollout` returns ``num_steps`` steps
    of all envs, acted by the workers' copies. Before each rollout a worker lets ``sync``
    decide, from ``KL(π_learner ‖ π_local)`` on its own recent observations (see
    :mod:`clusterenv.policy.strategies`) or from the version lag, whether to pull the latest published
    weights. With ``prefetch=0`` plain ``envs.step(actions)`` keeps working between
    rollouts: a rollout continues from wherever the envs are. With ``prefetch >= 1`` the
    runner holds the envs from its first rollout until :meth:`stop`. One runner per env at
    a time: a new runner's policy replaces the old one's in the workers.

    A worker replaced after a failure (``on_worker_failure="restart"``), or the survivor that
    takes its envs (``"rehome"``), gets the policy at the current version, and the lost
    worker's rollouts in flight are run again there on freshly reset
    envs, flagged ``infos[0]["worker_restarted"]`` (the cut episode ends unflagged at the
    previous batch's ``next_obs``, from which the learner bootstraps). With
    ``on_worker_failure="raise"`` a lost worker raises ``WorkerLostError`` and closes the envs.

    Observations reach the policy as the observation space structures them, batched along
    the first axis: one tensor ``(B, *obs_shape)`` for a ``Box``, ``Discrete``,
    ``MultiDiscrete`` or ``MultiBinary`` space; a dict of tensors (keys in the space's
    order) for a ``Dict`` space and a tuple of tensors for a ``Tuple`` space, nested as the
    space is. Floating leaves arrive as float32, integer leaves (uint8 images, Discrete
    indices) in their own dtype, for the module to scale or embed. Nothing is flattened:
    a module that wants one flat vector can be given envs wrapped in Gymnasium's
    ``FlattenObservation`` (which one-hot encodes Discrete leaves). The batches keep the
    same structure and the leaves' own dtypes (see :class:`RolloutBatch`). Spaces
    without a fixed array form (``Text``, ``Graph``, ``Sequence``) are refused.

    The learner's policy may live on a GPU (CUDA or MPS): the workers still get CPU copies
    (architecture and weights travel as CPU data, so workers need no GPU), each
    :meth:`publish` copies the weights to the host in one transfer, and the learner's outputs
    on the probe states (for the KL checks) are computed on the policy's device.

    Examples:
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

    # The class of each mode, keyed by whether it prefetches; each mode enters itself when its
    # class is defined (``class LockstepRunner(PolicyRunner, prefetching=False)``).
    _modes: ClassVar[dict[bool, type[PolicyRunner]]] = {}

    def __init_subclass__(cls, *, prefetching: bool | None = None, **kwargs: Any) -> None:
        """Enter ``cls`` as the runner of its mode: lockstep (``prefetching=False``) or prefetching (``True``).

        A subclass that names no mode is left out: ``PolicyRunner(...)`` never returns it.
        """
        super().__init_subclass__(**kwargs)
        if prefetching is not None:
            PolicyRunner._modes[prefetching] = cls

    def __new__(cls, *args: Any, prefetch: int = 0, **kwargs: Any) -> PolicyRunner:
        """The runner of the mode ``prefetch`` asks for: lockstep (0) or prefetching (1 or more)."""
        if cls is PolicyRunner:
            prefetching = check_prefetch(prefetch) > 0
            if prefetching not in PolicyRunner._modes:
                raise PolicyError(
                    "`PolicyRunner` has no class for "
                    f"{'prefetching' if prefetching else 'lockstep'} rollouts: import it from "
                    "`clusterenv` or `clusterenv.learner.rollouts`, which load both modes."
                )
            cls = PolicyRunner._modes[prefetching]
        return super().__new__(cls)

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
        prefetch: int = 0,
        device: str | torch.device | None = None,
        weights: str | LossyWeights | None = None,
    ) -> None:
        """Ship the policy (version 0) to every worker.

        Args:
            envs: the environments; their workers get the policy.
            policy: a ``torch.nn.Module`` mapping observations ``(B, *obs_shape)`` (a dict or
                tuple of such tensors for ``Dict``/``Tuple`` spaces) to outputs ``(B, width)``
                (logits, Q-values, or the head's parameters), or a zero-argument callable returning one.
            sync: when workers pull new weights; default :class:`~clusterenv.policy.strategies.EveryUpdate`.
            head: how outputs become the acting distribution; default
                :func:`~clusterenv.policy.heads.default_head` of the action space (Discrete: softmax).
                Use ``EpsilonGreedy`` for Q-values.
            seed: seeds each env's action-sampling generator as ``default_rng([seed, env_index])``,
                and ``envs.reset(seed=seed)`` if the envs were never reset.
            probe_steps: how many of a worker's latest steps (times its envs) the KL is measured on.
            measure_kl: also measure the KL for strategies that do not need it (for telemetry).
            timeout: seconds a rollout may take per call; default ``envs.timeout``.
            prefetch: rollouts each worker collects ahead of the learner (0: lockstep).
            device: where the policy lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``); default:
                the device of its parameters. It is a check, not a move: a device this process
                cannot use, or one other than the policy's, raises :class:`PolicyError`.
            weights: how pulls ship the weights (:mod:`clusterenv.policy.deltas`): ``"full"`` (the whole
                tensors), ``"lossless"`` (a compressed XOR delta from the worker's version, rebuilt bit for
                bit), ``"lossy"`` or a :class:`~clusterenv.policy.deltas.LossyWeights` (quantized deltas
                with error feedback, checked by a KL guard; needs the KL probes). Default: lossless to
                workers on other hosts, full copies to workers on this one.
        """
        from torch import nn

        from clusterenv.policy.shipping import (
            LocalPolicy,
            pack_architecture,
            resolve_device,
            snapshot_weights,
            validate_policy,
        )

        if not isinstance(envs, ClusterEnv):
            raise TypeError(f"`envs` must be a ClusterEnv, whose workers can hold a policy, got {type(envs).__name__}.")
        envs.place_every_env_in_workers("a PolicyRunner (the workers act)")
        if envs.autoreset_mode == AutoresetMode.DISABLED:
            raise PolicyError(
                "Rollouts need the envs to reset themselves: use autoreset_mode NEXT_STEP or SAME_STEP, not DISABLED."
            )
        if not isinstance(policy, nn.Module) and callable(policy):
            policy = policy()
        if not isinstance(policy, nn.Module):
            raise PolicyError(
                f"`policy` must be a torch.nn.Module (or a zero-argument callable returning one), "
                f"got {type(policy).__name__}."
            )
        sync = EveryUpdate() if sync is None else sync
        if not isinstance(sync, SyncStrategy):
            raise PolicyError(f"`sync` must be a SyncStrategy such as APS(threshold=0.01), got {sync!r}.")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 1:
            raise PolicyError(f"`probe_steps` must be a positive integer, got {probe_steps!r}.")
        weights_spec = check_weights_spec(weights)
        if isinstance(weights_spec, LossyWeights) and not (measure_kl or sync.needs_kl):
            raise PolicyError(
                "Lossy weights are checked by a KL guard on the workers' probe states: keep `measure_kl=True` "
                "(or use weights='lossless')."
            )
        self.envs, self.sync, self.seed, self.prefetch = envs, sync, seed, check_prefetch(prefetch)
        self.head: Head = default_head(envs.single_action_space) if head is None else head
        self.probe_steps = probe_steps
        self.send_probes = measure_kl or sync.needs_kl
        self.timeout = timeout
        self._device = resolve_device(policy, device)
        self._policy = policy
        self._architecture = pack_architecture(policy)
        self._names, self._weights = snapshot_weights(policy)
        self._learner: LocalPolicy = LocalPolicy(self._architecture, self._names, self._weights, version=0)
        # Validated as the workers will run it, on CPU; then the learner's copy moves to the policy's device.
        validate_policy(self._learner.module, envs.single_observation_space, envs.single_action_space, self.head)
        self._learner.to(self._device)
        self._version = 0
        self._num_leaves = len(leaf_specs(envs.single_observation_space))
        # Per worker, its latest probe states: one array per observation leaf, (states, *leaf_shape).
        self._probe_obs: list[list[np.ndarray] | None] = [None] * envs.num_workers
        self._telemetry = Telemetry([WorkerTelemetry(w) for w in range(envs.num_workers)])
        self._movement: LearnerMovement | None = None
        if sync.needs_movement:
            previous = LocalPolicy(self._architecture, self._names, self._weights, version=0)
            previous.to(self._device)
            self._movement = LearnerMovement(previous, self._telemetry)
        pool = envs.pool
        self._shipments = WeightShipments(weights_spec, self._telemetry, lambda w: pool.members.host(w))
        self._ship(cloudpickle.dumps(sync))

    # -- shipping --------------------------------------------------------------------------
    def _ship(self, strategy: bytes) -> None:
        self._strategy = strategy
        with self.envs.pending_call() as pool:
            for w in range(pool.num_workers):
                self._send_policy(pool, w)
            pool.gather(range(pool.num_workers), "installing the local policies", self._timeout())
        # A replacement worker (on_worker_failure="restart"), or whoever takes its envs ("rehome"),
        # gets the policy back, at the current version.
        pool.on_restart(weak_callback(self._reinstall))

    def _send_policy(self, pool: WorkerPool, worker_id: int) -> None:
        policy = self._policy_message(worker_id)
        pool.send(worker_id, policy.kind, policy.meta, policy.arrays, policy.blobs, on_loss=policy.on_loss)

    def _policy_message(self, worker_id: int) -> FollowUp:
        """The SET_POLICY that installs the current version on worker ``worker_id`` (counted as sent)."""
        digest = self._shipments.installed(worker_id, self._version, self._weights)
        meta = SetPolicyMeta(names=self._names, version=self._version, seed=self.seed, digest=digest)
        size = len(self._architecture) + sum(a.nbytes for a in self._weights)
        self._telemetry.workers[worker_id].initial_bytes += size
        return FollowUp(Kind.SET_POLICY, meta, self._weights, [self._architecture, self._strategy], OnLoss.RAISE)

    def _reinstall(self, worker_id: int) -> list[FollowUp]:
        """A restart hook: the policy again, at the current version, on the worker's new host."""
        self._probe_obs[worker_id] = None
        awaited = f"installing the local policy on a replacement for worker {worker_id}"
        return [self._policy_message(worker_id)._replace(awaited=awaited, timeout=self._timeout())]

    def _timeout(self) -> float | None:
        return self.envs.timeout if self.timeout is None else self.timeout

    def publish(self, policy: nn.Module | None = None) -> int:
        """Make the current weights of ``policy`` (default: the one given) the learner's next version.

        It snapshots the weights (so later training does not change this version) for
        workers to pull when their strategy says so. In prefetch mode it also answers the
        pulls waiting for it and sends each worker the new version's outputs on its probe states.
        A policy on a GPU is copied to the host in one transfer; the learner's copy for the KL
        probes is updated device to device.

        Returns:
            The new learner version.
        """
        from torch import nn

        from clusterenv.policy.shipping import snapshot_weights

        source = self._policy if policy is None else policy
        if not isinstance(source, nn.Module):
            raise PolicyError(
                f"`policy` must be a torch.nn.Module to publish, got {type(source).__name__}; "
                "to publish a state_dict, load it into the module first (`module.load_state_dict(...)`)."
            )
        names, weights = snapshot_weights(source)
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
        if self._movement is not None:
            self._movement.replacing(self._learner.module, self._version)
        self._version += 1
        self._weights = weights
        self._learner.copy_from(source, self._version)
        self._published()
        return self._version

    @abc.abstractmethod
    def _published(self) -> None:
        """What a mode does once a version is published (a prefetching runner tells its workers)."""

    @property
    def device(self) -> torch.device:
        """The device of the learner's policy, where the KL probes' learner outputs are computed."""
        return self._device

    @property
    def version(self) -> int:
        """The latest published learner version (0: the weights shipped with the policy)."""
        return self._version

    @property
    def prefetch_backlog(self) -> list[tuple[int, int]]:
        """Per worker, ``(held, in_flight)``: results received but not yet returned, and rollouts still being collected.

        Both stay within ``prefetch`` beyond what :meth:`rollout`/:meth:`fragments` asked for; all zeros
        without prefetching or after :meth:`stop`.
        """
        return [(0, 0)] * self.envs.num_workers

    @property
    def telemetry(self) -> Telemetry:
        """A snapshot of the per-worker and total sync telemetry."""
        snapshot = copy.deepcopy(self._telemetry)
        snapshot.learner_version = self._version
        return snapshot

    # -- rollouts --------------------------------------------------------------------------
    #: Whether a worker's probe states are taken from each batch as it is assembled (lockstep),
    #: rather than from each result as it arrives (prefetch).
    probes_from_batches = True

    @abc.abstractmethod
    def rollout(self, num_steps: int, *, head: Head | None = None) -> RolloutBatch:
        """``num_steps`` steps of every env, acted by the workers' local policies.

        With ``prefetch=k`` this returns the oldest complete batch, waiting only if it is not
        there yet, and asks each worker for one more; successive batches continue each
        other exactly. ``num_steps`` cannot change between calls, and ``head`` applies to the
        rollout requested now, which is returned ``k`` calls later.

        Args:
            num_steps: ``T``, steps per env.
            head: the acting head (e.g. ``EpsilonGreedy`` with the current epsilon); default ``self.head``.

        Returns:
            The transitions, see :class:`RolloutBatch`.
        """

    def fragments(self, num_steps: int, *, head: Head | None = None) -> Iterator[RolloutBatch]:
        """Yield each worker's ``num_steps`` steps as soon as they arrive, for off-policy learners.

        A fragment is a :class:`RolloutBatch` of one worker's envs (``env_ids``), so that a
        replay buffer never waits for the slowest worker. Each worker keeps ``prefetch``
        rollouts ahead (at least one). ``head`` applies to the rollouts requested from then on.
        Successive fragments of one worker continue each other exactly.
        """
        self._check_steps(num_steps)
        raise PolicyError("fragments() streams rollouts ahead of the learner: make the runner with prefetch >= 1.")

    def stop(self) -> list[RolloutBatch]:
        """End prefetching: wait for the rollouts collected ahead and return them, oldest first.

        Nothing is lost: the returned batches (fragments, after :meth:`fragments`) hold every
        step the workers took ahead. Afterwards the envs accept ``step``/``reset`` again, and
        the next ``rollout`` starts prefetching anew.
        """
        return []

    def _check_steps(self, num_steps: int) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"`num_steps` must be a positive integer, got {num_steps!r}.")

    # -- learner-side probes and pulls ------------------------------------------------------
    def _probe_outputs(self, head: Head | None = None) -> list[np.ndarray | None]:
        """The latest version's outputs on each worker's probe states, in one forward pass.

        Where the strategy needs the learner's movement, it is measured on the same states
        (with ``head``, default ``self.head``).
        """
        present = [obs for obs in self._probe_obs if obs is not None]
        if not present:
            return [None] * len(self._probe_obs)
        leaves = [np.concatenate(leaf) for leaf in zip(*present, strict=True)]
        obs_tree = unflatten(self.envs.single_observation_space, leaves)
        flat = self._learner.outputs(obs_tree)
        slices: list[slice | None] = []
        start = 0
        for obs in self._probe_obs:
            if obs is None:
                slices.append(None)
            else:
                slices.append(slice(start, start + len(obs[0])))
                start += len(obs[0])
        if self._movement is not None:
            self._movement.measure(self.head if head is None else head, obs_tree, flat, slices, self._version)
        return [None if rows is None else flat[rows] for rows in slices]

    def _movement_of(self, worker_id: int) -> float | None:
        """The learner's movement for worker ``worker_id``'s KL check (None: not needed, or not known yet)."""
        return None if self._movement is None else self._movement.of(worker_id)

    def _answer_pull(self, worker_id: int, msg: Message) -> bool:
        if msg.kind is not Kind.WEIGHTS_REQUEST:
            return False
        self._send_weights(worker_id, Kind.SET_WEIGHTS, meta_of(msg, WeightsRequestMeta))
        return True

    def _send_weights(self, worker_id: int, kind: Kind, request: WeightsRequestMeta | None = None) -> None:
        """Ship the latest version to a worker, as :class:`WeightShipments` finds cheapest (``request``: its pull).

        A lossy delta goes only to a worker that has the learner's outputs on its probe states,
        at this version, for its guard.
        """
        guarded = self.send_probes and self._probe_obs[worker_id] is not None
        shipments = self._shipments
        meta, frames = shipments.shipment(worker_id, self._version, self._weights, request=request, guarded=guarded)
        self.envs.pool.send(worker_id, kind, meta, frames)

    def _keep_probe_states(self, worker_id: int, obs: list[np.ndarray]) -> None:
        """Keep the last ``probe_steps`` steps of a rollout's observation leaves ``(T, n, ...)``, as the worker does."""
        self._probe_obs[worker_id] = probe_rows(obs, self.probe_steps)

    # -- assembling ------------------------------------------------------------------------
    def _frames(self, worker_id: int, msg: Message) -> tuple[list[np.ndarray], dict[str, np.ndarray], list[np.ndarray]]:
        """A ROLLOUT_RESULT's observation leaves, other transition arrays by name, and next observation leaves."""
        try:
            return split_rollout_frames(msg.arrays, self._num_leaves)
        except ProtocolError as exc:
            raise ProtocolError(f"Worker {worker_id} answered a rollout wrongly: {exc}") from None

    def _assemble(self, replies: dict[int, Message], steps: int) -> RolloutBatch:
        """One batch from the workers in ``replies`` (all of them, or one for a fragment), in env order."""
        envs = self.envs
        slices = [envs.worker_slices[w] for w in sorted(replies)]
        num_envs = sum(sl.stop - sl.start for sl in slices)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in ROLLOUT_FIELDS[1:]}
        obs_parts: list[list[np.ndarray]] = []  # per worker, its observation leaves
        next_parts: list[list[np.ndarray]] = []
        logs: list[tuple[int, list[InfoPayload]]] = []
        restarted: list[InfoRecord] = []
        offset = 0
        for w, sl in zip(sorted(replies), slices, strict=True):
            msg = replies[w]
            if msg.kind is not Kind.ROLLOUT_RESULT:
                raise ProtocolError(f"Worker {w} answered a rollout with {msg.kind.name} and {len(msg.arrays)} arrays.")
            obs, transitions, next_obs = self._frames(w, msg)
            for name, array in transitions.items():
                parts[name].append(array)
            obs_parts.append(obs)
            next_parts.append(next_obs)
            record = self._telemetry.workers[w]
            lags, counts = np.unique(self._version - transitions["policy_versions"], return_counts=True)
            for lag, count in zip(lags.tolist(), counts.tolist(), strict=True):
                record.lag_counts[lag] += count
            meta = meta_of(msg, RolloutResultMeta)
            if meta["kl"] is not None:
                record.record_kl(float(meta["kl"]))
            if self.probes_from_batches:
                self._keep_probe_states(w, obs)
            if msg.blobs[0]:
                logs.append((offset, envs.pool.loads(msg.blobs[0])))
            if meta["restarted"]:
                restarted += [(offset + i, info) for i, info in restarted_records(sl.stop - sl.start)]
            offset += sl.stop - sl.start
        infos: list[dict[str, Any]] = []
        for t in range(steps):
            info: dict[str, Any] = {}
            for start, worker_logs in logs:
                info = merge_infos(info, worker_logs[t], num_envs, start)
            infos.append(info)
        if restarted:  # a replacement's envs started new episodes at step 0
            infos[0] = replay_infos(infos[0], restarted, num_envs, 0)
        arrays = {name: np.concatenate(values, axis=1) for name, values in parts.items()}
        # Per leaf, the workers' columns side by side; then the leaves in the observation space's structure.
        space = envs.single_observation_space
        obs_tree = unflatten(space, [np.concatenate(leaf, axis=1) for leaf in zip(*obs_parts, strict=True)])
        next_tree = unflatten(space, [np.concatenate(leaf, axis=0) for leaf in zip(*next_parts, strict=True)])
        env_ids = np.concatenate([np.arange(sl.start, sl.stop) for sl in slices])
        return RolloutBatch(
            obs=obs_tree, next_obs=next_tree, **arrays, infos=infos, learner_version=self._version, env_ids=env_ids
        )
