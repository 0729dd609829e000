"""``make_vec``: ``gymnasium.make_vec`` with the envs in ClusterEnv workers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium import Env, Wrapper, error
from gymnasium.envs.registration import EnvSpec

from clusterenv.env import ClusterEnv

__all__ = ["make_vec"]


def make_vec(
    id: str | EnvSpec,
    num_envs: int = 1,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[Env], Wrapper]] | None = None,
    **kwargs: Any,
) -> ClusterEnv:
    """Create a :class:`ClusterEnv` of ``num_envs`` copies of env ``id``.

    Same arguments and meaning as :func:`gymnasium.make_vec`, except that there is no
    ``vectorization_mode``: ``vector_kwargs`` go to :class:`ClusterEnv` (``num_workers``,
    ``autoreset_mode``, ...), ``wrappers`` are applied to each env inside its worker, and
    ``kwargs`` go to the env constructor. A ``vectorization_mode`` keyword is accepted and
    ignored, so that a ``gymnasium.make_vec`` call needs no other change. The returned env's
    ``spec`` records all of this, so ``clusterenv.make_vec(envs.spec)`` makes the same envs again.

    Example:
        >>> import clusterenv
        >>> envs = clusterenv.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"num_workers": 2})
        >>> envs
        ClusterEnv(CartPole-v1, num_envs=4, num_workers=2)
        >>> envs.close()
    """
    if isinstance(id, EnvSpec):
        env_spec = id
    elif isinstance(id, str):
        env_spec = gym.spec(id)
    else:
        raise error.Error(f"Invalid id type: {type(id)}. Expected `str` or `EnvSpec`")
    if env_spec.entry_point is None:
        raise error.Error(f"Cannot create vectorized environment for {env_spec.id}: it has no entry point.")
    env_spec = copy.deepcopy(env_spec)
    env_kwargs = dict(env_spec.kwargs)
    env_spec.kwargs = {}
    # The spec of a vector env made by make_vec records how it was made, so that it can be remade from it.
    num_envs = env_kwargs.pop("num_envs", num_envs)
    env_kwargs.pop("vectorization_mode", None)
    vector_kwargs = env_kwargs.pop("vector_kwargs", vector_kwargs)
    wrappers = env_kwargs.pop("wrappers", wrappers)
    env_kwargs.update(kwargs)
    env_kwargs.pop("vectorization_mode", None)
    if isinstance(num_envs, bool) or not isinstance(num_envs, int):
        raise TypeError(f"`num_envs` must be an integer, got {type(num_envs).__name__} ({num_envs!r}).")
    if num_envs < 1:
        raise ValueError(f"`num_envs` must be at least 1, got {num_envs}.")
    vector_kwargs = dict(vector_kwargs or {})
    wrappers = list(wrappers or [])

    def create_single_env() -> Env:
        env = gym.make(env_spec, **copy.deepcopy(env_kwargs))
        for wrapper in wrappers:
            env = wrapper(env)
        return env

    envs = ClusterEnv([create_single_env] * num_envs, **vector_kwargs)
    spec = copy.deepcopy(env_spec)
    spec.kwargs = dict(env_kwargs)
    if num_envs != 1:
        spec.kwargs["num_envs"] = num_envs
    spec.kwargs["vectorization_mode"] = "clusterenv"
    if vector_kwargs:
        spec.kwargs["vector_kwargs"] = vector_kwargs
    if wrappers:
        spec.kwargs["wrappers"] = wrappers
    envs.unwrapped.spec = spec
    return envs
