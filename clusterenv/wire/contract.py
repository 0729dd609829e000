"""The ``SyncVectorEnv`` contract that both of clusterenv's vector envs keep, and how envs split into parts.

The learner's ``ClusterEnv`` splits its envs over workers, and a worker's
``ProcVectorEnv`` splits its slice over env processes: both check spaces and per-env
values as ``SyncVectorEnv`` does, with its messages, and route per-env work by the same
contiguous parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import batch_differing_spaces, batch_space

__all__ = [
    "by_part",
    "check_spaces",
    "in_index_order",
    "per_env_seeds",
    "per_env_values",
    "split_evenly",
    "values_by_part",
    "vector_spaces",
]


def check_spaces(
    observation_spaces: list[spaces.Space], action_spaces: list[spaces.Space], observation_mode: str
) -> None:
    """Every env's spaces fit env 0's, checked as ``SyncVectorEnv`` checks them, with its messages.

    Each worker's ``SyncVectorEnv`` checks its own envs; this checks across workers.
    """
    single_observation_space, single_action_space = observation_spaces[0], action_spaces[0]
    for observation_space, action_space in zip(observation_spaces, action_spaces, strict=True):
        if observation_mode == "same" and observation_space != single_observation_space:
            raise RuntimeError(
                "SyncVectorEnv(..., observation_mode='same') however the sub-environments observation spaces are not "
                f"equivalent. single_observation_space={single_observation_space}, sub-environment "
                f"observation_space={observation_space}. If this is intentional, use `observation_mode='different'` "
                "instead."
            )
        if action_space != single_action_space:
            raise RuntimeError(
                "Sub-environment action space doesn't make the `single_action_space`, "
                f"action_space={action_space}, single_action_space={single_action_space}"
            )


def vector_spaces(
    observation_spaces: list[spaces.Space], action_spaces: list[spaces.Space], observation_mode: Any
) -> tuple[spaces.Space, spaces.Space, spaces.Space, spaces.Space]:
    """The batch's spaces, as ``SyncVectorEnv`` derives them.

    Returned as ``(single_observation_space, observation_space, single_action_space, action_space)``.

    ``observation_mode`` is ``"same"``, ``"different"``, or a given ``(observation_space,
    single_observation_space)``, against which each worker checked its own envs.
    """
    custom = isinstance(observation_mode, tuple)
    check_spaces(observation_spaces, action_spaces, "custom" if custom else observation_mode)
    single_observation_space = observation_spaces[0]
    if custom:
        observation_space, single_observation_space = observation_mode
    elif observation_mode == "same":
        observation_space = batch_space(single_observation_space, len(observation_spaces))
    else:
        observation_space = batch_differing_spaces(observation_spaces)
    return (
        single_observation_space,
        observation_space,
        action_spaces[0],
        batch_space(action_spaces[0], len(action_spaces)),
    )


def per_env_values(values: Any, num_envs: int) -> list[Any] | tuple[Any, ...]:
    """``set_attr``'s values: one per env, or one value for all (as ``SyncVectorEnv.set_attr`` takes them)."""
    if not isinstance(values, (list, tuple)):
        return [values for _ in range(num_envs)]
    if len(values) != num_envs:
        raise ValueError(
            "Values must be a list or tuple with length equal to the number of environments. "
            f"Got `{len(values)}` values for {num_envs} environments."
        )
    return values


def per_env_seeds(seed: int | Sequence[int | None] | None, num_envs: int) -> list[int | None]:
    """Each env's seed, as ``SyncVectorEnv.reset`` derives them: ``seed=n`` gives env ``i`` the seed ``n + i``."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, int):
        return [seed + i for i in range(num_envs)]
    if len(seed) != num_envs:
        raise ValueError(
            f"If seeds are passed as a list the length must match num_envs={num_envs} but got length={len(seed)}."
        )
    return [None if value is None else int(value) for value in seed]


def split_evenly(num_envs: int, parts: int) -> list[slice]:
    """``parts`` contiguous slices of ``range(num_envs)`` whose sizes differ by at most one.

    How envs are split over workers, and a worker's slice over its env processes.
    """
    bounds = np.linspace(0, num_envs, parts + 1).round().astype(int)
    return [slice(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def by_part(indices: list[int] | None, parts: Sequence[slice]) -> dict[int, list[int] | None]:
    """Per part holding any of ``indices``, their indices within that part, in the order given.

    ``parts`` are contiguous slices of the envs (workers' slices, or a worker's env
    processes' parts); ``indices=None`` means every env of every part (``None`` for each).
    """
    if indices is None:
        return dict.fromkeys(range(len(parts)))
    grouped: dict[int, list[int]] = {}
    for i in indices:
        k = next(k for k, part in enumerate(parts) if part.start <= i < part.stop)
        grouped.setdefault(k, []).append(i - parts[k].start)
    return dict(grouped)


def in_index_order(
    indices: list[int] | None, parts: Sequence[slice], results: Mapping[int, Sequence[Any]]
) -> list[Any]:
    """Each part's results (for its :func:`by_part` indices) in the order of ``indices`` (``None``: env order)."""
    if indices is None:
        return [value for k in sorted(results) for value in results[k]]
    value_of: dict[int, Any] = {}
    for k, local in by_part(indices, parts).items():
        value_of.update(zip((parts[k].start + i for i in local or ()), results[k], strict=True))
    return [value_of[i] for i in indices]


def values_by_part(
    indices: list[int] | None, parts: Sequence[slice], values: Sequence[Any]
) -> dict[int, tuple[list[int] | None, list[Any]]]:
    """Per part holding any of ``indices``: its :func:`by_part` indices and the values meant for them.

    ``values`` holds one value per index of ``indices`` (``None``: one per env), as
    ``set_attr`` takes them once :func:`per_env_values` has checked them.
    """
    value_of = dict(zip(range(parts[-1].stop) if indices is None else indices, values, strict=True))
    routed = {}
    for k, local in by_part(indices, parts).items():
        part = parts[k]
        chosen = range(part.stop - part.start) if local is None else local
        routed[k] = (local, [value_of[part.start + i] for i in chosen])
    return routed
