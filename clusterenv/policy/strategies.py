"""When a worker's local policy copy pulls fresh weights: KL checks, strategies, telemetry.

The divergence a worker measures is::

    KL(π_learner ‖ π_local) = mean over probe states s of
                              Σ_a π_learner(a|s) · (log π_learner(a|s) − log π_local(a|s))

(an integral over actions for continuous heads), where both distributions come from the
same :class:`~clusterenv.policy.heads.Head` applied to the learner's latest outputs and the
worker's local outputs on the same states, each head computing it exactly (``Head.kl``), and the
probe states are the worker's own most recent observations: the last ``probe_steps``
steps of its previous rollout, over all of its envs. The mean (not the sum) keeps the
threshold independent of how many states and envs are probed.

The direction weights the log-ratio by the *learner's* distribution: it is large when the
learner now favours actions that the acting copy makes unlikely, which is what blows up
the importance ratios ``π_learner / π_local`` of an off-policy-corrected update.

Every strategy answers one question, in the worker, once per rollout: pull now or not.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from clusterenv.errors import PolicyError
from clusterenv.policy.heads import Head, kl_divergence

__all__ = [
    "APS",
    "EveryUpdate",
    "FixedInterval",
    "Never",
    "SyncStrategy",
    "Telemetry",
    "WorkerTelemetry",
    "kl_divergence",
    "mean_kl",
    "probe_rows",
]


def probe_rows(leaves: list[np.ndarray], probe_steps: int) -> list[np.ndarray]:
    """A rollout's probe states: the last ``probe_steps`` steps of each ``(T, n, ...)`` leaf, as rows (steps × envs).

    The learner and the worker both slice a rollout with this, so the KL compares their
    outputs on the same states, row for row (the worker slices its outputs the same way).
    """
    probe = min(probe_steps, len(leaves[0]))
    return [leaf[len(leaf) - probe :].reshape(-1, *leaf.shape[2:]).copy() for leaf in leaves]


def mean_kl(head: Head, learner_outputs: np.ndarray, local_outputs: np.ndarray) -> float:
    """``KL(π_learner ‖ π_local)`` averaged over the rows (probe states) of both output arrays, by ``head.kl``."""
    if learner_outputs.shape != local_outputs.shape:
        raise PolicyError(
            f"Learner outputs have shape {learner_outputs.shape} but the worker's probe outputs have shape "
            f"{local_outputs.shape}; both must be (probe states, outputs per state)."
        )
    return float(np.mean(head.kl(learner_outputs, local_outputs)))


class SyncStrategy:
    """Decides, in the worker before each rollout, whether to pull the learner's weights.

    ``needs_kl`` tells the learner to send its outputs on the worker's probe states; a
    strategy that does not need them may still receive them so the KL is logged.
    """

    needs_kl: ClassVar[bool] = False
    #: Pulls every new version as soon as it hears of it: a prefetching learner pushes versions instead.
    pulls_every_version: ClassVar[bool] = False

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """Whether to pull, given the acting copy's version, the learner's, and the measured KL (None if unmeasured)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Never(SyncStrategy):
    """Keep the weights shipped with the policy forever (a lower bound for comparisons)."""

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """Never."""
        return False


@dataclass(frozen=True)
class EveryUpdate(SyncStrategy):
    """Pull whenever the learner has published a newer version: always on-policy, most traffic."""

    pulls_every_version: ClassVar[bool] = True

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """When the copy is behind."""
        return learner_version > local_version


@dataclass(frozen=True)
class FixedInterval(SyncStrategy):
    """Pull once the copy is ``every_n_updates`` versions behind (policy lag stays below that).

    Args:
        every_n_updates: a positive integer; 1 is :class:`EveryUpdate`.
    """

    every_n_updates: int

    def __post_init__(self) -> None:
        if (
            isinstance(self.every_n_updates, bool)
            or not isinstance(self.every_n_updates, int)
            or self.every_n_updates < 1
        ):
            raise PolicyError(f"`every_n_updates` must be a positive integer, got {self.every_n_updates!r}.")

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """When the copy is at least ``every_n_updates`` versions behind."""
        return learner_version - local_version >= self.every_n_updates


@dataclass(frozen=True)
class APS(SyncStrategy):
    """Adaptive Policy Synchronization: pull exactly when the measured KL exceeds ``threshold``.

    The KL is ``KL(π_learner ‖ π_local)`` averaged over the worker's probe states (see the
    module docstring). Before the first rollout nothing can be measured; then the worker
    pulls only if the learner has already published a newer version.

    Args:
        threshold: a positive, finite KL in nats.
    """

    threshold: float
    needs_kl: ClassVar[bool] = True

    def __post_init__(self) -> None:
        value = self.threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PolicyError(f"`threshold` must be a positive finite KL (nats), got {value!r}.")

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """``kl > threshold``; without a measurement, whether the copy is behind."""
        if kl is None:
            return learner_version > local_version
        return kl > self.threshold


@dataclass
class WorkerTelemetry:
    """What one worker's local policy has cost and how far it has lagged.

    Attributes:
        worker_id: the worker (``-1`` for the total over workers).
        pulls: weight shipments after the initial one: the strategy's pulls, and exact copies the lossy guard asked for.
        weight_bytes: bytes of weight arrays (or delta frames) sent by those pulls.
        full_pulls: pulls answered with the whole weights.
        delta_pulls: pulls answered with a delta (``full_pulls + delta_pulls == pulls``).
        guard_trips: exact copies asked for because a lossy delta moved the policy past ``guard_kl``.
        initial_bytes: bytes of the architecture and weights sent once by the policy shipment.
        probe_bytes: bytes of learner outputs sent for KL checks.
        kl_checks: number of KL measurements.
        last_kl: the latest measured KL, or None.
        kl_sum: sum of the measured KLs (``mean_kl`` divides it by ``kl_checks``).
        lag_counts: env steps acted at each policy lag (learner version minus acting version).
    """

    worker_id: int
    pulls: int = 0
    weight_bytes: int = 0
    full_pulls: int = 0
    delta_pulls: int = 0
    guard_trips: int = 0
    initial_bytes: int = 0
    probe_bytes: int = 0
    kl_checks: int = 0
    last_kl: float | None = None
    kl_sum: float = 0.0
    lag_counts: Counter[int] = field(default_factory=Counter)

    @property
    def mean_kl(self) -> float | None:
        """Mean of the measured KLs, or None before the first."""
        return self.kl_sum / self.kl_checks if self.kl_checks else None

    @property
    def steps(self) -> int:
        """Env steps acted by the local policy."""
        return sum(self.lag_counts.values())

    @property
    def mean_lag(self) -> float | None:
        """Mean policy lag per env step, or None before the first rollout."""
        steps = self.steps
        return sum(lag * n for lag, n in self.lag_counts.items()) / steps if steps else None

    def record_kl(self, kl: float) -> None:
        """Add one KL measurement."""
        self.kl_checks += 1
        self.last_kl = kl
        self.kl_sum += kl


@dataclass
class Telemetry:
    """Per-worker telemetry and its total; a snapshot, safe to keep.

    Attributes:
        workers: one :class:`WorkerTelemetry` per worker, in worker order.
        learner_version: the latest published version.
    """

    workers: list[WorkerTelemetry]
    learner_version: int = 0

    @property
    def total(self) -> WorkerTelemetry:
        """Sums over workers; ``last_kl`` is the mean of the workers' last KLs."""
        total = WorkerTelemetry(worker_id=-1)
        last = [w.last_kl for w in self.workers if w.last_kl is not None]
        for w in self.workers:
            total.pulls += w.pulls
            total.weight_bytes += w.weight_bytes
            total.full_pulls += w.full_pulls
            total.delta_pulls += w.delta_pulls
            total.guard_trips += w.guard_trips
            total.initial_bytes += w.initial_bytes
            total.probe_bytes += w.probe_bytes
            total.kl_checks += w.kl_checks
            total.kl_sum += w.kl_sum
            total.lag_counts.update(w.lag_counts)
        total.last_kl = float(np.mean(last)) if last else None
        return total

    def summary(self) -> dict[str, float]:
        """Flat scalars for a logger: ``sync/pulls``, ``sync/weight_bytes``, ``sync/delta_pulls``, ..."""
        total = self.total
        out: dict[str, float] = {
            "sync/pulls": total.pulls,
            "sync/weight_bytes": total.weight_bytes,
            "sync/full_pulls": total.full_pulls,
            "sync/delta_pulls": total.delta_pulls,
            "sync/guard_trips": total.guard_trips,
            "sync/probe_bytes": total.probe_bytes,
            "sync/learner_version": self.learner_version,
        }
        for name, value in (("last_kl", total.last_kl), ("mean_kl", total.mean_kl), ("mean_lag", total.mean_lag)):
            if value is not None:
                out[f"sync/{name}"] = value
        return out
