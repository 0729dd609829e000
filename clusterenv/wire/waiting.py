"""How the shared step path waits: a bounded spin on a sequence word, then a blocking read.

A process woken from a blocking read costs tens of µs on a VM (waking an idle vCPU), more
than a step of 16 CartPoles. While steps come faster than that, reading the other side's
counter in a loop is cheaper than sleeping; once they stop coming (a long PPO update), a
waiter must block, so that the cores go to whoever computes. :class:`SpinBudget` says how
long to spin: a fixed bound, or one adapted to how long recent waits took. Spinning is only
ever chosen where every spinning process has a core of its own (:func:`spinners_fit`).
"""

from __future__ import annotations

import logging
import os

__all__ = ["DEFAULT_SPIN_CAP_S", "MIN_SPIN_S", "SpinBudget", "spinners_fit", "usable_cores", "yield_core"]

logger = logging.getLogger(__name__)

#: The longest an adaptive spin lasts: a step's gap in a training loop (a policy's forward pass
#: on the CPU, a few hundred µs) fits, while a learning update (tens of ms and more) does not.
DEFAULT_SPIN_CAP_S = 1e-3
#: What an adaptive spin keeps while recent waits outlast the cap: about one wake-up on a VM.
MIN_SPIN_S = 30e-6
# How much one wait moves the typical wait (an exponential average).
_WEIGHT = 0.125


def yield_core() -> None:
    """Let another runnable process have this core for a moment (about 0.5 µs when none is waiting).

    A spinner calls it every few µs: on a machine busier than the rule assumed (other jobs,
    a noisy neighbour), the process it waits for may be queued behind it on its own core.
    """
    sched_yield = getattr(os, "sched_yield", None)  # POSIX; where it is missing a spinner only spins
    if sched_yield is not None:
        sched_yield()


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within the cgroup's CPU quota where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota)) if quota is not None else max(1, cores)


def _cgroup_quota() -> int | None:
    """Whole cores allowed by a cgroup v2 ``cpu.max`` quota (``None``: no quota, or no cgroup v2)."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, int(int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def spinners_fit(spinners: int) -> bool:
    """Whether ``spinners`` processes may spin at once: never more than the usable cores (the learner is one)."""
    return spinners <= usable_cores()


class SpinBudget:
    """How long a waiter spins before it blocks.

    Args:
        fixed_s: a fixed bound in seconds (``0``: never spin); ``None``: adapt within ``cap_s``.
        cap_s: the adaptive bound's most.

    Adaptive: while recent waits end within the cap, spin up to the cap (they end while
    spinning, without a wake-up); while they outlast it, spin only :data:`MIN_SPIN_S`, and
    block, so that the training loop's own compute gets the cores.
    """

    def __init__(self, fixed_s: float | None, cap_s: float = DEFAULT_SPIN_CAP_S) -> None:
        self.fixed_s = fixed_s
        self.cap_s = cap_s
        self._typical = 0.0  # exponential average of recent waits, each counted at most twice the cap
        #: Waits that ended while spinning, and all waits (for ``worker_info``/benchmarks).
        self.caught = 0
        self.waits = 0

    @property
    def spins(self) -> bool:
        """Whether this waiter ever spins."""
        return self.fixed_s is None or self.fixed_s > 0

    def bound(self) -> float:
        """Seconds to spin for the next wait."""
        if self.fixed_s is not None:
            return self.fixed_s
        return self.cap_s if self._typical <= self.cap_s else MIN_SPIN_S

    def observe(self, waited_s: float, caught: bool) -> None:
        """A wait ended after ``waited_s`` seconds, while spinning (``caught``) or after blocking."""
        self.waits += 1
        self.caught += caught
        self._typical += _WEIGHT * (min(waited_s, 2 * self.cap_s) - self._typical)

    def describe(self) -> dict[str, float | int | str | None]:
        """What ``worker_info``/``learner_info`` show: the rule, the bound now, and how many waits ended spinning."""
        rule = "never" if not self.spins else "fixed" if self.fixed_s is not None else "adaptive"
        return {
            "spin": rule,
            "spin_us": round(self.bound() * 1e6, 1),
            "waits": self.waits,
            "caught_spinning": self.caught,
        }
