"""Where a ``ClusterEnv``'s envs run when the user names no layout: how many workers, how many envs the learner steps.

The rule, for local workers stepping in lockstep: **one worker per usable core but one, and
the learner stepping one worker's share of the envs itself** (``num_envs // (workers + 1)``).
The learner would wait for the workers anyway; stepping a share meanwhile costs it nothing
but the steps, and leaves a core to each worker, so that every process can spin instead of
paying a wake-up (tens of µs on a VM, more than a step of 16 CartPoles). Measured on two
cores (docs/benchmarks.md, "The default layout"), this layout beats one worker per core on
every cell, from a null env to HalfCheetah, and the PPO example end to end.

The learner steps no env where it could not serve them, and the layout is then one
worker per usable core (at most one per entry of ``env_fns``):

- remote workers (``launcher="external"``, Ray, ``srun``): the learner's host is not theirs;
- first-ready batches (``batch_size``): whole workers come back in the order they are ready;
- ``on_worker_failure="restart"`` or ``"rehome"``, or ``recycle``: they replace worker processes
  or move their envs, and an env the learner steps has no process of its own to replace;
- ``procs_per_worker > 1``: each worker spreads its envs over child processes itself;
- units (an entry of ``env_fns`` that makes a vector env): the learner steps single envs only.

A mode that cannot use the learner's share and starts after the envs are built (a
``PolicyRunner``, ``async_reset``/``send``/``recv``) moves it to the workers once
(:meth:`ClusterEnv.place_every_env_in_workers`). An explicit ``num_workers`` or
``learner_envs`` always wins.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "choose_layout", "workers_and_learner", "workers_only_layout"]


@dataclass(frozen=True)
class Layout:
    """How many worker processes, how many envs the learner steps itself, and why."""

    num_workers: int
    learner_envs: int
    #: One line for ``repr(envs)`` and ``learner_info``: which rule chose it, from what.
    reason: str
    #: Whether the default rule chose it (no ``num_workers`` nor ``learner_envs`` given).
    by_default: bool


def choose_layout(
    num_entries: int,
    cores: int,
    *,
    num_workers: int | None = None,
    learner_envs: int | None = None,
    local: bool = True,
    first_ready: bool = False,
    replaces_workers: bool = False,
    procs_per_worker: int = 1,
    units: bool = False,
) -> Layout:
    """The layout of ``num_entries`` entries of ``env_fns`` on ``cores`` usable cores.

    Args:
        num_entries: the entries of ``env_fns`` (a unit counts once).
        cores: the usable cores (:func:`clusterenv.cores.usable_cores`).
        num_workers: the user's worker count, if given: it is kept.
        learner_envs: the user's learner share, if given: it is kept.
        local: whether the workers are local child processes (``launcher="local"``).
        first_ready: whether ``batch_size`` asks for first-ready batches.
        replaces_workers: whether lost workers are restarted or their envs moved (``on_worker_failure``
            ``"restart"`` or ``"rehome"``), or workers are recycled (``recycle``).
        procs_per_worker: env processes per worker.
        units: whether the learner's share would hold a unit (it steps single envs only).
    """
    if num_workers is not None or learner_envs is not None:
        own = 0 if learner_envs is None else learner_envs
        workers = num_workers if num_workers is not None else _one_per_core(num_entries - own, cores - (own > 0))
        return Layout(workers, own, _explicit(num_workers, learner_envs), by_default=False)
    why_not = _learner_cannot_step(local, first_ready, replaces_workers, procs_per_worker, units)
    if why_not is not None:
        workers = _one_per_core(num_entries, cores)
        return Layout(workers, 0, f"one worker per core ({cores}), the learner steps none: {why_not}", True)
    return workers_and_learner(num_entries, cores)


def workers_and_learner(num_entries: int, cores: int) -> Layout:
    """The rule for local lockstep workers: a worker per core but the learner's, the learner one worker's share."""
    workers = max(1, min(cores - 1, num_entries - 1))
    own = num_entries // (workers + 1)
    if own == 0:  # a single env: it goes to a worker
        return Layout(workers, 0, f"{workers} worker{_s(workers)} for {num_entries} env, the learner steps none", True)
    return Layout(
        workers,
        own,
        f"{cores} core{_s(cores)}: {workers} worker{_s(workers)} and the learner, which steps {own} of "
        f"{num_entries} envs itself",
        True,
    )


def workers_only_layout(layout: Layout, num_entries: int, cores: int, mode: str) -> Layout:
    """The default layout once ``mode`` (a ``PolicyRunner``, first-ready batches) needs every env in a worker.

    The workers stay as many as the rule chose: on two cores, one worker acting or stepping
    every env beats two (docs/benchmarks.md).
    """
    return Layout(
        layout.num_workers,
        0,
        f"{cores} core{_s(cores)}: {layout.num_workers} worker{_s(layout.num_workers)} stepping all {num_entries} "
        f"envs, for {mode}",
        True,
    )


def _learner_cannot_step(
    local: bool, first_ready: bool, replaces_workers: bool, procs_per_worker: int, units: bool
) -> str | None:
    if not local:
        return "remote workers"
    if first_ready:
        return "first-ready batches (`batch_size`)"
    if replaces_workers:
        return "worker processes are replaced (on_worker_failure or recycle), and the learner's envs have none"
    if procs_per_worker > 1:
        return "`procs_per_worker` spreads the envs over processes"
    if units:
        return "the first entries of `env_fns` make vector envs (units)"
    return None


def _one_per_core(num_entries: int, cores: int) -> int:
    return max(1, min(cores, num_entries))


def _explicit(num_workers: int | None, learner_envs: int | None) -> str:
    given = (("num_workers", num_workers), ("learner_envs", learner_envs))
    return "as given: " + ", ".join(f"{name}={value}" for name, value in given if value is not None)


def _s(count: int) -> str:
    return "" if count == 1 else "s"
