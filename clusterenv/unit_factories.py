"""Factories of units that are made where they run: one EnvPool per worker, one copy of a PettingZoo game.

A unit is an entry of ``env_fns`` that makes a whole vector env (:mod:`clusterenv.worker.units`).
These factories travel to the workers pickled, like any env factory, and decide there what
only the worker's host knows (its cores). A worker imports this module to unpickle them, so it
imports no tier of clusterenv, only :mod:`clusterenv.cores` (which imports nothing): EnvPool,
SuperSuit and PettingZoo are imported when a unit is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from clusterenv.cores import usable_cores

__all__ = ["EnvPoolShare", "PettingZooCopy"]


@dataclass(frozen=True)
class EnvPoolShare:
    """One worker's share of an EnvPool: ``num_envs`` envs of ``task_id``, seeded ``seed, seed + 1, ...``.

    EnvPool seeds env ``i`` of a pool made with ``seed=s`` with ``s + i``, so the shares of a
    ``ClusterEnv``, seeded ``s + k`` at slot ``k``, are together one EnvPool seeded ``s``.

    Args:
        task_id: EnvPool's task id (``"CartPole-v1"``, ``"Pong-v5"``).
        num_envs: the envs of this share.
        seed: the seed of its first env.
        num_threads: EnvPool's threads; ``None``: the usable cores of the host it is made on
            (:func:`clusterenv.cores.usable_cores`), divided by ``workers_per_host``.
        workers_per_host: how many shares are made on one host (local workers: all of them).
        kwargs: other arguments of ``envpool.make`` (``episodic_life``, ``img_height``, ...).
    """

    task_id: str
    num_envs: int
    seed: int
    num_threads: int | None = None
    workers_per_host: int = 1
    kwargs: dict[str, Any] = field(default_factory=dict)

    def threads(self) -> int:
        """The threads this share's EnvPool runs, on the host where it is made."""
        if self.num_threads is not None:
            return self.num_threads
        return max(1, usable_cores() // self.workers_per_host)

    def __call__(self) -> Any:
        """Make the EnvPool: a ``gymnasium.vector.VectorEnv`` (``NEXT_STEP`` autoreset), untyped in EnvPool."""
        import envpool

        threads = min(self.threads(), self.num_envs)
        return envpool.make(
            self.task_id,
            env_type="gymnasium",
            num_envs=self.num_envs,
            batch_size=self.num_envs,
            seed=self.seed,
            num_threads=threads,
            **self.kwargs,
        )


@dataclass(frozen=True)
class PettingZooCopy:
    """Copy ``index`` of a PettingZoo parallel game as SuperSuit's vector env: one slot per agent.

    SuperSuit's ``concat_vec_envs_v1`` seeds copy ``i`` with ``seed + i``; a ``ClusterEnv``
    seeds the unit at slot ``k`` (here ``index * agents``) with ``seed + k``. This copy takes
    the ``ClusterEnv``'s seed back to SuperSuit's, so that the two match copy for copy.

    Args:
        parallel_env_fn: makes the game (a PettingZoo ``ParallelEnv``, wrapped as you like).
        index: which copy this is.
    """

    parallel_env_fn: Callable[[], Any]
    index: int

    def __call__(self) -> VectorEnv:
        """Make the copy: ``supersuit.pettingzoo_env_to_vec_env_v1`` of a fresh game."""
        import supersuit

        game = supersuit.pettingzoo_env_to_vec_env_v1(self.parallel_env_fn())
        return _SuperSuitCopy(game, self.index)


class _SuperSuitCopy(VectorWrapper):
    """SuperSuit's vector env with its autoreset mode declared and its copy's seed as SuperSuit gives it.

    SuperSuit resets a game within the step that ends it (its ``terminal_observation`` info
    holds the last observations): ``SAME_STEP``, which its metadata does not say.
    """

    def __init__(self, env: VectorEnv, index: int) -> None:
        super().__init__(env)
        self.index = index
        self.metadata = {**env.metadata, "autoreset_mode": AutoresetMode.SAME_STEP}
        self.single_observation_space = env.observation_space
        self.single_action_space = env.action_space

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        """Reset the game; the slot seed ``s + index * agents`` becomes SuperSuit's ``s + index``."""
        if isinstance(seed, int):
            seed = seed - self.index * self.num_envs + self.index
        return self.env.reset(seed=seed, options=options)
