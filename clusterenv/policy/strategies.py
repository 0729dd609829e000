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

The learner's *movement* is its own per-version change on the same probe states,
``KL(π_v ‖ π_{v-1})``, averaged over a worker's probe states and smoothed over versions
(:data:`MOVEMENT_SMOOTHING`). The default :class:`APS` compares the copy's divergence with it,
so its one setting is in units every task shares: multiples of the learner's own per-version change.

Every strategy answers one question, in the worker, once per rollout: pull now or not.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import numpy as np

from clusterenv.errors import PolicyError
from clusterenv.policy.heads import Head, kl_divergence

__all__ = [
    "APS",
    "DEFAULT_UPDATES",
    "MOVEMENT_SMOOTHING",
    "KL_FLOOR",
    "PullReason",
    "EveryUpdate",
    "FixedInterval",
    "Never",
    "SyncStrategy",
    "Telemetry",
    "WorkerTelemetry",
    "kl_divergence",
    "mean_kl",
    "probe_rows",
    "state_kls",
]


def probe_rows(leaves: list[np.ndarray], probe_steps: int) -> list[np.ndarray]:
    """A rollout's probe states: the last ``probe_steps`` steps of each ``(T, n, ...)`` leaf, as rows (steps × envs).

    The learner and the worker both slice a rollout with this, so the KL compares their
    outputs on the same states, row for row (the worker slices its outputs the same way).
    """
    probe = min(probe_steps, len(leaves[0]))
    return [leaf[len(leaf) - probe :].reshape(-1, *leaf.shape[2:]).copy() for leaf in leaves]


def state_kls(head: Head, learner_outputs: np.ndarray, local_outputs: np.ndarray) -> np.ndarray:
    """``KL(π_learner ‖ π_local)`` on each row (probe state) of both output arrays, by ``head.kl``."""
    if learner_outputs.shape != local_outputs.shape:
        raise PolicyError(
            f"Learner outputs have shape {learner_outputs.shape} but the worker's probe outputs have shape "
            f"{local_outputs.shape}; both must be (probe states, outputs per state)."
        )
    return np.asarray(head.kl(learner_outputs, local_outputs))


def mean_kl(head: Head, learner_outputs: np.ndarray, local_outputs: np.ndarray) -> float:
    """``KL(π_learner ‖ π_local)`` averaged over the rows (probe states) of both output arrays."""
    return float(np.mean(state_kls(head, learner_outputs, local_outputs)))


#: The default :class:`APS` bound: the copy's KL may reach this many times the learner's per-version movement.
DEFAULT_UPDATES = 16.0
#: The smallest relative bound, in nats: below it the copy's outputs differ from the learner's by arithmetic
#: (float32 on another device, another batch shape), not by drift, and a pull would change nothing.
KL_FLOOR = 1e-6
#: The weight of the previous estimate in the learner's movement (an exponential moving average over versions).
MOVEMENT_SMOOTHING = 0.8


class PullReason(str, Enum):
    """Why a worker pulled weights, as the telemetry counts it (``WorkerTelemetry.pull_reasons``)."""

    #: The bound could not be judged, and the copy was behind: no KL measured yet (the first
    #: rollout), or, for ``APS()``, no learner movement known yet (or a strategy that does not take it).
    BEHIND = "behind"
    #: The measured KL crossed the strategy's bound (APS).
    DIVERGENCE = "divergence"
    #: The version schedule said so (EveryUpdate, FixedInterval).
    SCHEDULE = "schedule"
    #: A lossy delta moved the copy past its guard, or a delta could not be rebuilt: an exact copy.
    REPAIR = "repair"
    #: A prefetching learner pushed a version to a strategy that pulls every version.
    PUSH = "push"


class SyncStrategy:
    """Decides, in the worker before each rollout, whether to pull the learner's weights.

    ``needs_kl`` tells the learner to send its outputs on the worker's probe states; a
    strategy that does not need them may still receive them so the KL is logged.
    ``needs_movement`` tells it to also measure its own per-version change on those states,
    which then reaches :meth:`should_pull` as ``movement``.
    """

    needs_kl: ClassVar[bool] = False
    #: Pulls every new version as soon as it hears of it: a prefetching learner pushes versions instead.
    pulls_every_version: ClassVar[bool] = False

    @property
    def needs_movement(self) -> bool:
        """Whether :meth:`should_pull` takes the learner's movement (a ``movement`` keyword)."""
        return False

    def should_pull(self, *, local_version: int, learner_version: int, kl: float | None) -> bool:
        """Whether to pull, given the acting copy's version, the learner's, and the measured KL (None if unmeasured)."""
        raise NotImplementedError

    def reason(self, kl: float | None, *, movement: float | None = None) -> PullReason:
        """Why a pull this strategy decided on happened (for the telemetry)."""
        return PullReason.BEHIND if kl is None and self.needs_kl else PullReason.SCHEDULE

    def divergence(self, per_state: np.ndarray) -> float:
        """The KL :meth:`should_pull` is given, from the KL on each probe state: their mean."""
        return float(np.mean(per_state))


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
    """Adaptive Policy Synchronization: pull when the copy's KL from the learner crosses a bound.

    The KL is ``KL(π_learner ‖ π_local)`` averaged over the worker's probe states (see the
    module docstring). Before the first rollout nothing can be measured; then the worker
    pulls only if the learner has already published a newer version.

    ``APS()`` bounds the KL relative to the learner's own movement: a worker pulls once its
    copy's KL exceeds ``updates`` times the KL one learner version moves the policy,
    ``KL > max(updates × movement, KL_FLOOR)``, both measured on the same probe states. The
    bound's unit is the task's own step size, so one setting serves tasks whose policies move
    at very different rates. While the learner keeps its direction the copy's KL grows faster
    than linearly with its lag, so it pulls after fewer than ``updates`` versions (every 7 to
    10 in the PPO sweeps). The movement is per published version: publishing several times
    per rollout makes each step, and the bound, smaller. ``APS(threshold)`` bounds the KL
    absolutely, in nats.

    What it guarantees: at every lockstep rollout start, after the decision, a copy behind
    the learner has a KL on the worker's probe states of at most the bound
    (``max(updates × movement, KL_FLOOR)`` nats, or ``threshold``); a copy at the learner's
    version holds its weights (within their ``guard_kl`` with lossy weights), and is not
    pulled again. It bounds nothing on other states, nor the lag in versions; as the
    learner slows down (a learning rate annealed toward 0) the relative bound shrinks with
    it, and the copy follows the learner closely. Why this default, measured on five PPO
    task settings: docs/aps-evidence.md.

    Args:
        threshold: an absolute bound, a positive finite KL in nats; exclusive with ``updates``.
        updates: the relative bound, a positive finite multiple of the learner's per-version
            movement; default :data:`DEFAULT_UPDATES` when ``threshold`` is not given.
        statistic: how the probe states' KLs make the one compared with an absolute ``threshold``:
            ``"mean"`` (default), ``"p95"`` (their 95th percentile) or ``"max"``. The relative
            bound compares means, as the learner's movement is one.
    """

    threshold: float | None = None
    updates: float | None = None
    statistic: str = "mean"
    needs_kl: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.threshold is not None and self.updates is not None:
            raise PolicyError(
                f"APS takes an absolute `threshold` or a relative `updates`, not both "
                f"(got threshold={self.threshold!r}, updates={self.updates!r})."
            )
        if not isinstance(self.statistic, str) or self.statistic not in _STATISTICS:
            raise PolicyError(f"`statistic` must be one of {sorted(_STATISTICS)}, got {self.statistic!r}.")
        if self.threshold is not None:
            _check_positive("threshold", self.threshold, "KL (nats)")
        else:
            if self.statistic != "mean":
                raise PolicyError(
                    f"statistic={self.statistic!r} needs an absolute `threshold`: the relative bound compares means."
                )
            if self.updates is None:
                object.__setattr__(self, "updates", DEFAULT_UPDATES)
            _check_positive("updates", self.updates, "multiple of the learner's per-version movement")

    @property
    def needs_movement(self) -> bool:
        """The relative bound needs the learner's movement, unless a subclass's ``should_pull`` predates it."""
        return self.threshold is None and _takes_movement(type(self).should_pull)

    def bound(self, movement: float | None) -> float | None:
        """The KL above which the worker pulls (None: not known yet, without the learner's movement)."""
        if self.threshold is not None:
            return self.threshold
        if movement is None:
            return None
        return max(float(self.updates) * movement, KL_FLOOR)  # type: ignore[arg-type]

    def should_pull(
        self, *, local_version: int, learner_version: int, kl: float | None, movement: float | None = None
    ) -> bool:
        """Whether the copy is behind and ``kl > bound``; without a measured KL or bound, whether it is behind."""
        behind = learner_version > local_version
        bound = self.bound(movement)
        if kl is None or bound is None:
            return behind
        return behind and kl > bound

    def reason(self, kl: float | None, *, movement: float | None = None) -> PullReason:
        """Divergence once a KL and its bound were known, else the copy was behind."""
        return PullReason.BEHIND if kl is None or self.bound(movement) is None else PullReason.DIVERGENCE

    def divergence(self, per_state: np.ndarray) -> float:
        """The probe states' KLs reduced by :attr:`statistic`."""
        return _STATISTICS[self.statistic](per_state)


_STATISTICS = {
    "mean": lambda kls: float(np.mean(kls)),
    "p95": lambda kls: float(np.quantile(kls, 0.95)),
    "max": lambda kls: float(np.max(kls)),
}


@functools.cache
def _takes_movement(should_pull: Callable[..., bool]) -> bool:
    """Whether a class's ``should_pull`` takes ``movement`` (once per class: workers ask every rollout)."""
    parameters = inspect.signature(should_pull).parameters.values()
    return any(p.name == "movement" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _check_positive(name: str, value: object, unit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise PolicyError(f"`{name}` must be a positive finite {unit}, got {value!r}.")


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
        pull_reasons: pulls by :class:`PullReason` value (they add up to ``pulls``).
        movement: the learner's latest movement on this worker's probe states (see the module
            docstring), or None where no strategy needed it.
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
    pull_reasons: Counter[str] = field(default_factory=Counter)
    movement: float | None = None

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
        """Sums over workers; ``last_kl`` and ``movement`` are the means of the workers' latest."""
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
            total.pull_reasons.update(w.pull_reasons)
        total.last_kl = float(np.mean(last)) if last else None
        movements = [w.movement for w in self.workers if w.movement is not None]
        total.movement = float(np.mean(movements)) if movements else None
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
        for reason in PullReason:
            out[f"sync/pulls_{reason.value}"] = total.pull_reasons[reason.value]
        measured = (
            ("last_kl", total.last_kl),
            ("mean_kl", total.mean_kl),
            ("mean_lag", total.mean_lag),
            ("movement", total.movement),
        )
        for name, value in measured:
            if value is not None:
                out[f"sync/{name}"] = value
        return out
