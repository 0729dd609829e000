"""Does clusterenv return exactly what ``SyncVectorEnv`` returns for this env? The first difference if not.

Both get the same env factories, ``reset(seed=...)`` and the same actions, drawn from a seeded
batched action space; every field of every step is compared bit for bit (NaN equal to NaN).
Step 0 is the reset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["STEP_FIELDS", "Difference", "Exactness", "check_exact", "first_difference"]


STEP_FIELDS = ("observations", "rewards", "terminations", "truncations", "infos")


@dataclass(frozen=True)
class Difference:
    """Where the two first disagree.

    Attributes:
        step: the batch step (0: the reset).
        field: ``observations``, ``rewards``, ``terminations``, ``truncations`` or ``infos``, with the
            key path into a dict (``infos['lives']``, ``observations['image']``).
        env_index: the first env that differs, or None where the field's structure differs (keys, shapes).
        expected: what ``SyncVectorEnv`` returned there, shortened.
        got: what clusterenv returned there, shortened.
    """

    step: int
    field: str
    env_index: int | None
    expected: str
    got: str

    def __str__(self) -> str:
        where = "" if self.env_index is None else f", env {self.env_index}"
        return f"step {self.step}, {self.field}{where}: SyncVectorEnv {self.expected}, clusterenv {self.got}"


@dataclass(frozen=True)
class Exactness:
    """The outcome: how many batch steps were compared, and the first difference (None: exact)."""

    steps: int
    difference: Difference | None

    @property
    def exact(self) -> bool:
        """Whether every field of every step was equal."""
        return self.difference is None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == object:
            return all(_equal(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    try:
        return bool(a == b) or (a != a and b != b)  # NaN equal to NaN
    except Exception:
        return False


def first_difference(field: str, expected: Any, got: Any) -> tuple[str, int | None, Any, Any] | None:
    """The first place ``got`` differs from ``expected`` in a batched field: ``(field path, env index, expected, got)``.

    Dicts are followed key by key (their own key paths); anything else is batched along its
    first axis, and the env index is the first row that differs.
    """
    if isinstance(expected, dict) and isinstance(got, dict):
        if list(expected) != list(got):
            return field + " keys", None, list(expected), list(got)
        for key in expected:
            found = first_difference(f"{field}[{key!r}]", expected[key], got[key])
            if found:
                return found
        return None
    if _equal(expected, got):
        return None
    if isinstance(expected, tuple) and isinstance(got, tuple) and len(expected) == len(got):
        # A Tuple space batches per element: each element is itself batched along the envs.
        for i, (x, y) in enumerate(zip(expected, got, strict=True)):
            found = first_difference(f"{field}[{i}]", x, y)
            if found:
                return found
    a, b = np.asarray(expected, dtype=object), np.asarray(got, dtype=object)
    if a.ndim == 0 or b.ndim == 0 or len(a) != len(b):
        return field, None, expected, got
    index = next(i for i in range(len(a)) if not _equal(expected[i], got[i]))
    return field, index, expected[index], got[index]


def check_exact(
    make: Callable[[], gym.Env], num_envs: int, steps: int, seed: int, cluster_options: dict[str, Any]
) -> Exactness:
    """Step ``SyncVectorEnv`` and ``ClusterEnv(**cluster_options)`` side by side for ``steps`` batch steps."""
    from clusterenv.learner.vector_env import ClusterEnv

    fns = [make] * num_envs
    sync = gym.vector.SyncVectorEnv(fns)
    try:
        cluster = ClusterEnv(fns, **cluster_options)
    except BaseException:
        sync.close()
        raise
    try:
        found = _compare(0, ("observations", "infos"), sync.reset(seed=seed), cluster.reset(seed=seed))
        if found:
            return Exactness(0, found)
        space = sync.action_space
        space.seed(seed)
        for t in range(1, steps + 1):
            actions = space.sample()
            found = _compare(t, STEP_FIELDS, sync.step(actions), cluster.step(actions))
            if found:
                return Exactness(t, found)
        return Exactness(steps, None)
    finally:
        sync.close()
        cluster.close()


def _compare(step: int, fields: tuple[str, ...], expected: tuple[Any, ...], got: tuple[Any, ...]) -> Difference | None:
    for name, a, b in zip(fields, expected, got, strict=True):
        found = first_difference(name, a, b)
        if found:
            field, env_index, want, have = found
            return Difference(step, field, env_index, _short(want), _short(have))
    return None
