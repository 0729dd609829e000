"""How the shared step path waits: a bounded spin on a sequence word, then a blocking read.

A process woken from a blocking read costs tens of µs on a VM (waking an idle vCPU), more
than a step of 16 CartPoles. While steps come faster than that, reading the other side's
counter in a loop is cheaper than sleeping; once they stop coming (a long PPO update), a
waiter must block, so that the cores go to whoever computes. :class:`SpinBudget` says how
long to spin: a fixed bound, or one adapted to how long recent waits took. Spinning is only
ever chosen where every spinning process has a core of its own, counted over every
ClusterEnv in this process (:data:`SPIN_SEATS`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from clusterenv.cores import usable_cores

__all__ = [
    "DEFAULT_SPIN_CAP_S",
    "MIN_SPIN_S",
    "SPIN_SEATS",
    "Seats",
    "SpinBudget",
    "SpinSeats",
    "yield_core",
]

logger = logging.getLogger(__name__)

#: The longest an adaptive spin lasts: a step's gap in a training loop (a policy's forward pass
#: on the CPU, a few hundred µs) fits, while a learning update (tens of ms and more) does not.
DEFAULT_SPIN_CAP_S = 1e-3
#: What an adaptive spin keeps while recent waits outlast the cap: about one wake-up on a VM.
MIN_SPIN_S = 30e-6
# How much one wait moves the typical wait (an exponential average).
_WEIGHT = 0.125
# The most one wait counts for in the typical wait, in caps. Two or three waits in a row this
# long turn the spin off, while one among fast steps (a learning update between rollouts) does
# not; and after any run of them, however long each was (an evaluation of minutes), about a
# dozen fast waits turn it on again.
_LONGEST_WAIT_CAPS = 4.0


def yield_core() -> None:
    """Let another runnable process have this core for a moment (about 0.5 µs when none is waiting).

    A spinner calls it every few µs: on a machine busier than the rule assumed (other jobs,
    a noisy neighbour), the process it waits for may be queued behind it on its own core.
    """
    sched_yield = getattr(os, "sched_yield", None)  # POSIX; where it is missing a spinner only spins
    if sched_yield is not None:
        sched_yield()


class SpinBudget:
    """How long a waiter spins before it blocks.

    Args:
        fixed_s: a fixed bound in seconds (``0``: never spin); ``None``: adapt within ``cap_s``.
        cap_s: the adaptive bound's most.

    Adaptive: while recent waits end within the cap, spin up to the cap (they end while
    spinning, without a wake-up); while they outlast it, spin only :data:`MIN_SPIN_S`, and
    block, so that the training loop's own compute gets the cores. Each wait counts whole,
    from :meth:`begin` to :meth:`end`, the part spent blocked included: a wait is known to be
    long only once it ended, and counting only the spin that ran out (all a waiter knows when
    it blocks) would count every wait as short while the bound is short, turning the spin on
    again after every few waits. So the bound stays off while waits outlast the cap, and comes
    back when they are short again, whether they end within the short spin or after a block.
    """

    def __init__(self, fixed_s: float | None, cap_s: float = DEFAULT_SPIN_CAP_S) -> None:
        self.fixed_s = fixed_s
        self.cap_s = cap_s
        self._typical = 0.0  # exponential average of recent waits, each counted at most _LONGEST_WAIT_CAPS caps
        self._began: float | None = None  # when the wait in progress began (``time.perf_counter()``)
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

    def begin(self) -> float:
        """A wait begins now: the time (``time.perf_counter()``) its spin's bound counts from."""
        self._began = now = time.perf_counter()
        return now

    def end(self, caught: bool) -> None:
        """The wait begun last ended now, while spinning (``caught``) or after blocking; a wait counts once."""
        began, self._began = self._began, None
        if began is not None:
            self.observe(time.perf_counter() - began, caught)

    def observe(self, waited_s: float, caught: bool) -> None:
        """A wait ended after ``waited_s`` seconds in all, while spinning (``caught``) or after blocking."""
        self.waits += 1
        self.caught += caught
        self._typical += _WEIGHT * (min(waited_s, _LONGEST_WAIT_CAPS * self.cap_s) - self._typical)

    def describe(self) -> dict[str, float | int | str | None]:
        """What ``worker_info``/``learner_info`` show: the rule, the bound now, and how many waits ended spinning."""
        rule = "never" if not self.spins else "fixed" if self.fixed_s is not None else "adaptive"
        return {
            "spin": rule,
            "spin_us": round(self.bound() * 1e6, 1),
            "waits": self.waits,
            "caught_spinning": self.caught,
        }


class Seats:
    """A :class:`SpinSeats` claim's answer: whether its workers may spin, why, and the seats it holds.

    Args:
        reason: why (``learner_info``'s ``spin_rule``).
        free: what gives its seats back (``None``: it got none); it must not refer to this object.

    The seats go back with :meth:`release`, or when this object is garbage (an env never closed).
    """

    def __init__(self, reason: str, free: Callable[[], None] | None = None) -> None:
        self.reason = reason
        #: Whether the claim's workers (and the learner waiting for them) may spin.
        self.granted = free is not None
        self._release = None if free is None else weakref.finalize(self, free)

    def release(self) -> None:
        """Give the seats back (once; nothing for a claim that got none)."""
        if self._release is not None:
            self._release()


class SpinSeats:
    """The cores this process's spinners hold, shared by every ClusterEnv in it (a training env and an eval env).

    The learner process counts once (it waits for one env at a time), and each env's local
    workers that may spin take a seat each, from the moment its step path is made until it
    closes; together they never exceed :func:`usable_cores`. A claim that does not fit gets
    no seat: that env's workers, and its learner side, block.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # ClusterEnvs may be made and closed from several threads
        self._held: dict[int, int] = {}  # claim → its workers
        self._claims = itertools.count()

    def claim(self, workers: int) -> Seats:
        """Seats for ``workers`` spinning workers, if they fit beside the learner and every other claim's."""
        cores = usable_cores()
        with self._lock:
            held, others = sum(self._held.values()), sum(1 for seated in self._held.values() if seated)
            if 1 + held + workers <= cores:
                key = next(self._claims)
                self._held[key] = workers
                return Seats("every spinning process has a core", functools.partial(self._free, key))
        if 1 + workers > cores:
            return Seats(f"{1 + workers} spinning processes would not fit in this process's cores: all block")
        free = cores - 1 - held
        room = "no core" if free <= 0 else f"{free} core{'s' if free > 1 else ''} for {workers}"
        whose = "another ClusterEnv" if others == 1 else f"{others} other ClusterEnvs"
        spin = f"{held} worker{'s' if held != 1 else ''} spinning for {whose} in this process"
        return Seats(f"{spin} {'leaves' if held == 1 else 'leave'} {room}: all block")

    def held(self) -> int:
        """The workers holding a seat now."""
        with self._lock:
            return sum(self._held.values())

    def _free(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)


#: The one ledger of this process's spinners.
SPIN_SEATS = SpinSeats()
