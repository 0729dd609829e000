"""The rows of the table: which backends, with which options, this env and machine get.

ClusterEnv's rows are ``(label, ClusterEnv keyword options)`` pairs in :func:`clusterenv_options`,
the defaults first, so a new option becomes a row by adding one line there. A row that cannot
run here (EnvPool not installed or without this env, no MLP for these spaces) is left out with
the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym

from clusterenv.bench.backends import (
    ActingLoop,
    EnvPoolLoop,
    LearnerActingLoop,
    Loop,
    VectorLoop,
    acting_policy,
    envpool_knows,
)
from clusterenv.bench.target import EnvTarget
from clusterenv.learner.layout import workers_and_learner
from clusterenv.learner.vector_env import ClusterEnv
from clusterenv.policy.heads import Head

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ROLLOUT_STEPS", "Candidate", "acting_options", "candidates", "clusterenv_options", "worker_counts"]

# Steps per env in each rollout of the acting rows: one round trip per worker per rollout.
ROLLOUT_STEPS = 32

SYNC = "SyncVectorEnv"


@dataclass(frozen=True)
class Candidate:
    """One row: a backend with its options, and how to start it.

    Attributes:
        label: the row's name in the table.
        backend: ``SyncVectorEnv``, ``AsyncVectorEnv``, ``EnvPool``, ``ClusterEnv``, ``ClusterEnv+PolicyRunner``
            (workers act) or ``SyncVectorEnv+policy`` (the learner acts with the same MLP).
        options: the backend's keyword options as the report shows them (JSON values).
        start: builds the backend and returns its loop, reset and ready.
    """

    label: str
    backend: str
    options: dict[str, Any]
    start: Callable[[], Loop] = field(repr=False, compare=False)


def worker_counts(cores: int, num_envs: int) -> list[int]:
    """A few worker counts up to the usable cores: 1, a quarter, a half and all of them, at most one per env."""
    return sorted({min(count, num_envs) for count in (1, cores // 4, cores // 2, cores) if count >= 1})


def clusterenv_options(num_envs: int, cores: int) -> list[tuple[str, dict[str, Any]]]:
    """ClusterEnv's rows, ``(label, ClusterEnv keyword options)``: the defaults first, then other worker counts.

    The defaults (``ClusterEnv(env_fns)``) lay out the bench's local lockstep envs by
    :func:`~clusterenv.learner.layout.workers_and_learner`: a worker per core but one, the
    learner stepping one worker's share. That is the split the drop-in guide advises for cheap
    envs, so it has no row of its own. The other rows put every env in a worker process, at
    the worker counts of :func:`worker_counts`; one that is the defaults' layout (a single
    env) is left out.
    """
    default = workers_and_learner(num_envs, cores)
    rows: list[tuple[str, dict[str, Any]]] = [("clusterenv (defaults)", {})]
    rows += [
        (f"clusterenv num_workers={w}", {"num_workers": w})
        for w in worker_counts(cores, num_envs)
        if (w, 0) != (default.num_workers, default.learner_envs)
    ]
    return rows


def acting_options(num_envs: int, cores: int) -> list[tuple[str, dict[str, Any]]]:
    """The rows where workers act, ``(label, ClusterEnv keyword options)``: ClusterEnv's defaults."""
    return [("clusterenv, workers act (MLP)", {})]


def candidates(target: EnvTarget, num_envs: int, cores: int, seed: int) -> tuple[list[Candidate], list[str]]:
    """Every row this env can have here, ``SyncVectorEnv`` first, and a note for each row left out."""
    fns = [target.make] * num_envs
    rows = [
        Candidate(SYNC, SYNC, {}, lambda: VectorLoop(gym.vector.SyncVectorEnv(fns), seed)),
        Candidate(
            "AsyncVectorEnv",
            "AsyncVectorEnv",
            {"shared_memory": True},
            lambda: VectorLoop(gym.vector.AsyncVectorEnv(fns, shared_memory=True), seed),
        ),
    ]
    skipped = []
    if envpool_knows(target.env_id):
        assert target.env_id is not None
        env_id = target.env_id
        rows.append(
            Candidate("EnvPool", "EnvPool", {"num_threads": cores}, lambda: EnvPoolLoop(env_id, num_envs, cores, seed))
        )
    else:
        skipped.append("EnvPool: not installed, or it has no implementation of this env id")
    for label, options in clusterenv_options(num_envs, cores):
        rows.append(Candidate(label, "ClusterEnv", options, _cluster_loop(fns, options, seed)))

    probe = target.make()
    try:
        policy = acting_policy(probe.observation_space, probe.action_space)
    finally:
        probe.close()
    if isinstance(policy, str):
        skipped.append(f"workers acting: {policy}")
    else:
        mlp, head = policy
        rows.append(
            Candidate(
                "SyncVectorEnv, learner acts (MLP)",
                "SyncVectorEnv+policy",
                {},
                lambda: LearnerActingLoop(gym.vector.SyncVectorEnv(fns), mlp, head, seed),
            )
        )
        for label, options in acting_options(num_envs, cores):
            rows.append(
                Candidate(
                    label,
                    "ClusterEnv+PolicyRunner",
                    {**options, "rollout_steps": ROLLOUT_STEPS},
                    _acting_loop(fns, options, policy, seed),
                )
            )
    return rows, skipped


def _acting_loop(
    fns: list[Callable[[], gym.Env]], options: dict[str, Any], policy: tuple[nn.Module, Head], seed: int
) -> Callable[[], Loop]:
    mlp, head = policy
    return lambda: ActingLoop(ClusterEnv(fns, **options), mlp, head, ROLLOUT_STEPS, seed)


def _cluster_loop(fns: list[Callable[[], gym.Env]], options: dict[str, Any], seed: int) -> Callable[[], Loop]:
    return lambda: VectorLoop(ClusterEnv(fns, **options), seed)
