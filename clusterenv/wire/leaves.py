"""Flatten batched Gymnasium space values into the arrays that travel as raw frames.

Gymnasium batches a ``Tuple``/``Dict`` space into a tuple/dict of arrays; on the wire we
only want the leaf arrays, in a fixed order that both ends derive from the space alone.
Spaces without a fixed-size array form (``Text``, ``Graph``, ``Sequence``, ``OneOf``)
are not array trees: their values are pickled instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import iterate

__all__ = [
    "batch_of_items",
    "is_array_tree",
    "leaf_arrays",
    "leaf_specs",
    "unflatten",
]

_ARRAY_LEAVES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def is_array_tree(space: spaces.Space) -> bool:
    """Whether every leaf of ``space`` batches into one fixed-shape numpy array."""
    if isinstance(space, _ARRAY_LEAVES):
        return True
    if isinstance(space, spaces.Tuple):
        return all(is_array_tree(s) for s in space.spaces)
    if isinstance(space, spaces.Dict):
        return all(is_array_tree(s) for s in space.spaces.values())
    return False


def leaf_arrays(space: spaces.Space, batch: Any) -> list[np.ndarray]:
    """The leaf arrays of a batched value of ``space``, depth first, Dict keys in space order."""
    if isinstance(space, _ARRAY_LEAVES):
        return [batch]
    if isinstance(space, spaces.Tuple):
        return [leaf for s, b in zip(space.spaces, batch, strict=True) for leaf in leaf_arrays(s, b)]
    if isinstance(space, spaces.Dict):
        return [leaf for key, s in space.spaces.items() for leaf in leaf_arrays(s, batch[key])]
    raise TypeError(f"Space {space} has no fixed array form; its values must be pickled.")


def leaf_specs(space: spaces.Space) -> list[tuple[np.dtype, tuple[int, ...], spaces.Space]]:
    """``(dtype, single shape, leaf space)`` of each leaf of an unbatched ``space``."""
    if isinstance(space, _ARRAY_LEAVES):
        return [(np.dtype(space.dtype), tuple(space.shape or ()), space)]
    if isinstance(space, spaces.Tuple):
        return [spec for s in space.spaces for spec in leaf_specs(s)]
    if isinstance(space, spaces.Dict):
        return [spec for s in space.spaces.values() for spec in leaf_specs(s)]
    raise TypeError(f"Space {space} has no fixed array form; its values must be pickled.")


def unflatten(space: spaces.Space, leaves: list[np.ndarray]) -> Any:
    """Rebuild a batched value of ``space`` from its leaf arrays (inverse of :func:`leaf_arrays`)."""
    if isinstance(space, _ARRAY_LEAVES):  # the common case, without an iterator
        return leaves[0]
    return _build(space, iter(leaves))


def _build(space: spaces.Space, leaves: Iterator[np.ndarray]) -> Any:
    # A module function, not a closure: a recursive closure is a reference cycle that would keep
    # the leaves (views of shared memory, say) alive until the garbage collector runs.
    if isinstance(space, _ARRAY_LEAVES):
        return next(leaves)
    if isinstance(space, spaces.Tuple):
        return tuple(_build(child, leaves) for child in space.spaces)
    if isinstance(space, spaces.Dict):
        return {key: _build(child, leaves) for key, child in space.spaces.items()}
    raise TypeError(f"Space {space} has no fixed array form; its values must be pickled.")


def batch_of_items(batch_space: spaces.Space, items: list[Any]) -> Any:
    """A batched value of ``batch_space`` whose Gymnasium ``iterate`` yields exactly ``items``.

    The inverse of ``iterate``, for actions without a fixed array form: the learner splits a
    batch into the per-env items that ``SyncVectorEnv.step`` would hand each env, and a
    worker rebuilds its part with this, so its envs receive those very objects (no cast, no
    copy). It mirrors ``iterate``'s dispatch: a ``Dict`` or a ``Tuple`` of registered spaces
    is iterated per part; anything else by plain iteration.
    """
    if isinstance(batch_space, spaces.Dict):
        return {key: batch_of_items(s, [item[key] for item in items]) for key, s in batch_space.spaces.items()}
    if isinstance(batch_space, spaces.Tuple) and all(type(s) in iterate.registry for s in batch_space):
        return tuple(batch_of_items(s, [item[i] for item in items]) for i, s in enumerate(batch_space))
    return list(items)
