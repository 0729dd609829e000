"""PettingZoo parallel games across the cluster: copies of a game as units, one slot per agent.

``pip install "clusterenv-rl[pettingzoo]"``. The recipe SuperSuit users know,

.. code-block:: python

    env = supersuit.pettingzoo_env_to_vec_env_v1(pettingzoo.make("parallel", "butterfly/pistonball-v6"))
    envs = supersuit.concat_vec_envs_v1(env, 8, num_cpus=4, base_class="gymnasium")

becomes ``clusterenv.pettingzoo.make_vec(game, 8, num_workers=4)``, where
``game = functools.partial(pettingzoo.make, "parallel", "butterfly/pistonball-v6")``: each
copy of the game is SuperSuit's vector env over its agents, a unit that a worker steps whole
(docs/guides/units.md), and the ``ClusterEnv`` returns, step for step, what
``concat_vec_envs_v1(..., num_cpus=0, base_class="gymnasium")`` returns with the same copies and
seeds. SuperSuit seeds copy ``i`` with ``seed + i`` (not with its first slot), and so does this.

Unseeded, the copies differ from SuperSuit's: SuperSuit makes the game once and pickles a copy
of it per copy, while each worker here makes its copies from ``parallel_env_fn``. Seed a reset
(``reset(seed=s)``) and the two are equal from there on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clusterenv.learner.vector_env import ClusterEnv
from clusterenv.unit_factories import PettingZooCopy

__all__ = ["env_fns", "make_vec"]


def env_fns(parallel_env_fn: Callable[[], Any], num_envs: int) -> list[PettingZooCopy]:
    """The factories of ``num_envs`` copies of a game, for ``ClusterEnv`` or ``ClusterVecEnv`` (SB3).

    ``ClusterVecEnv(clusterenv.pettingzoo.env_fns(game, 8), num_workers=4)`` is SuperSuit's
    ``concat_vec_envs_v1(..., base_class="stable_baselines3")`` with clusterenv workers.

    Args:
        parallel_env_fn: makes the game (see :func:`make_vec`).
        num_envs: copies of the game.
    """
    if not callable(parallel_env_fn):
        raise TypeError(
            f"`parallel_env_fn` must be a callable that makes the game, got {type(parallel_env_fn).__name__}."
        )
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"`num_envs` (copies of the game) must be a positive int, got {num_envs!r}.")
    return [PettingZooCopy(parallel_env_fn, i) for i in range(num_envs)]


def make_vec(parallel_env_fn: Callable[[], Any], num_envs: int, **vector_kwargs: Any) -> ClusterEnv:
    """A :class:`~clusterenv.ClusterEnv` of ``num_envs`` copies of a PettingZoo parallel game.

    The env has ``num_envs × agents`` slots: copy ``i``'s agents, in ``possible_agents`` order,
    are slots ``i * agents`` to ``(i + 1) * agents - 1``, as in SuperSuit's
    ``concat_vec_envs_v1``. Every copy is reset in the step that ends its game (``SAME_STEP``:
    each agent's info then holds SuperSuit's ``terminal_observation``), and ``reset(seed=s)``
    seeds copy ``i`` with ``s + i``, as SuperSuit does.

    Args:
        parallel_env_fn: makes the game: a PettingZoo ``ParallelEnv`` (with SuperSuit's wrappers,
            if any: ``black_death_v3`` for games whose agents leave), called once per copy in the
            worker that steps it.
        num_envs: copies of the game (SuperSuit's ``num_vec_envs``).
        **vector_kwargs: :class:`~clusterenv.ClusterEnv`'s own arguments (``num_workers``, ...).

    Examples:
        >>> import functools, pettingzoo
        >>> import clusterenv.pettingzoo
        >>> game = functools.partial(pettingzoo.make, "parallel", "butterfly/pistonball-v6")
        >>> envs = clusterenv.pettingzoo.make_vec(game, 2, num_workers=1)
        >>> envs.num_envs, envs.single_observation_space.shape
        (40, (457, 120, 3))
        >>> envs.close()
    """
    if "env_fns" in vector_kwargs:
        raise TypeError("`env_fns` are made by clusterenv.pettingzoo.make_vec, one per copy of the game.")
    return ClusterEnv(env_fns(parallel_env_fn, num_envs), **vector_kwargs)
