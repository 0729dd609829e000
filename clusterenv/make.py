"""``make_vec``: ``gymnasium.make_vec`` with the envs in ClusterEnv workers."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium import Env, VectorizeMode, Wrapper, error
from gymnasium.envs.registration import EnvSpec

from clusterenv.launch.launchers import LocalLauncher
from clusterenv.learner.vector_env import ClusterEnv
from clusterenv.unit_factories import EnvPoolShare

__all__ = ["make_vec"]

logger = logging.getLogger(__name__)

# The env ids whose vector entry point this process was told it gave up: once per id.
_TOLD_VECTOR_ENTRY_POINT: set[str] = set()

# ``AsyncVectorEnv`` arguments about its own subprocesses and pipes: ClusterEnv's workers make them moot.
_ASYNC_ONLY_KWARGS = ("context", "daemon")
# Arguments that would change what runs in the workers: refused rather than silently dropped.
_UNSUPPORTED_KWARGS = {
    "worker": "a custom AsyncVectorEnv `worker` function replaces the code that runs the envs; ClusterEnv workers "
    "run their own (use `launcher=` to choose where they run)",
}


def make_vec(
    id: str | EnvSpec,
    num_envs: int = 1,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[Env], Wrapper]] | None = None,
    **kwargs: Any,
) -> ClusterEnv:
    """Create a :class:`ClusterEnv` of ``num_envs`` copies of env ``id``.

    Same arguments and meaning as :func:`gymnasium.make_vec`: ``vector_kwargs`` go to
    :class:`ClusterEnv` (``num_workers``, ``autoreset_mode``, ...), ``wrappers`` are applied to
    each env inside its worker, and ``kwargs`` go to the env constructor. The returned env's
    ``spec`` records all of this, so ``clusterenv.make_vec(envs.spec)`` makes the same envs again.

    The envs behave exactly as under ``vectorization_mode="sync"`` (one ``SyncVectorEnv``
    over all of them), whichever mode is given, so a ``gymnasium.make_vec`` call needs no
    other change:

    * ``"sync"``, ``"async"`` or none: the same. ``AsyncVectorEnv``'s ``shared_memory`` is
      :class:`ClusterEnv`'s own (whether workers on this host write observations into shared
      memory); its ``context`` and ``daemon`` are accepted and have no effect; a custom
      ``worker`` is refused.
    * ``"vector_entry_point"`` is refused: it asks for the env's own vectorized
      implementation (CartPole's ``CartPoleVectorEnv``), which runs in this process and
      whose trajectories differ. Note that ``gymnasium.make_vec(id, n)`` without a mode
      picks it when the env has one (CartPole, phys2d's CartPole and Pendulum): with no
      mode, this logs so (``logging.INFO``, once per env id and process), with how to keep
      it: its vector envs as units in ``env_fns`` (docs/guides/units.md).

    ``vector_kwargs={"units": "envpool"}`` makes EnvPool's task ``id`` instead: each worker builds
    one EnvPool of its share of the ``num_envs`` envs (a unit, docs/guides/units.md), with as many
    threads as its host has cores (divided among the workers this learner starts on its own
    host); ``kwargs`` then go to ``envpool.make`` (``seed``, default 0: env ``i`` is seeded
    ``seed + i``, as in one EnvPool; ``num_threads`` to choose the threads), and
    ``num_workers`` defaults to 1.

    Examples:
        >>> import clusterenv
        >>> envs = clusterenv.make_vec("CartPole-v1", num_envs=4)
        >>> envs  # the default layout and why; on 2 cores: num_workers=1, learner_envs=2  # doctest: +ELLIPSIS
        ClusterEnv(CartPole-v1, num_envs=4, num_workers=..., learner_envs=...: ...)
        >>> envs.close()
    """
    if vector_kwargs is not None and "units" in vector_kwargs:
        return _make_units(id, num_envs, dict(vector_kwargs), wrappers, kwargs)
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
    mode = env_kwargs.pop("vectorization_mode", None)
    vector_kwargs = env_kwargs.pop("vector_kwargs", vector_kwargs)
    wrappers = env_kwargs.pop("wrappers", wrappers)
    env_kwargs.update(kwargs)
    mode = env_kwargs.pop("vectorization_mode", mode)
    _check_mode(env_spec.id, mode)
    if mode is None and env_spec.vector_entry_point is not None:
        _tell_vector_entry_point_given_up(env_spec, num_envs)
    if isinstance(num_envs, bool) or not isinstance(num_envs, int):
        raise TypeError(f"`num_envs` must be an integer, got {type(num_envs).__name__} ({num_envs!r}).")
    if num_envs < 1:
        raise ValueError(f"`num_envs` must be at least 1, got {num_envs}.")
    vector_kwargs = _cluster_kwargs(vector_kwargs)
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


def _make_units(
    task_id: Any, num_envs: Any, vector_kwargs: dict[str, Any], wrappers: Any, kwargs: dict[str, Any]
) -> ClusterEnv:
    """``make_vec`` with ``vector_kwargs["units"]``: one unit per worker, made on its host."""
    units = vector_kwargs.pop("units")
    if units != "envpool":
        raise ValueError(f"`vector_kwargs['units']` must be 'envpool', got {units!r}.")
    if not isinstance(task_id, str):
        raise TypeError(f"With units='envpool', `id` must be an EnvPool task id (a str), got {type(task_id).__name__}.")
    if wrappers:
        raise ValueError("With units='envpool', `wrappers` cannot be applied: EnvPool's envs are not Gymnasium envs.")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ValueError(f"`num_envs` must be a positive int, got {num_envs!r}.")
    vector_kwargs = _cluster_kwargs(vector_kwargs)
    num_workers = vector_kwargs.setdefault("num_workers", 1)
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or not 1 <= num_workers <= num_envs:
        raise ValueError(f"`num_workers` must be an int between 1 and num_envs={num_envs}, got {num_workers!r}.")
    launcher = vector_kwargs.get("launcher")
    local = launcher is None or launcher == "local" or isinstance(launcher, LocalLauncher)
    seed, num_threads = kwargs.pop("seed", 0), kwargs.pop("num_threads", None)
    shares, start = [], 0
    for w in range(num_workers):
        size = num_envs // num_workers + (w < num_envs % num_workers)
        shares.append(EnvPoolShare(task_id, size, seed + start, num_threads, num_workers if local else 1, dict(kwargs)))
        start += size
    return ClusterEnv(shares, **vector_kwargs)


def _check_mode(env_id: str, mode: Any) -> None:
    """Accept the modes whose semantics ClusterEnv reproduces; refuse the one it cannot."""
    value = mode.value if isinstance(mode, VectorizeMode) else mode
    if value in (None, "sync", "async", "clusterenv"):
        return
    if value == VectorizeMode.VECTOR_ENTRY_POINT.value:
        raise ValueError(
            f"clusterenv.make_vec({env_id!r}, vectorization_mode='vector_entry_point') is not supported: that mode "
            "runs the env's own vectorized implementation in this process. clusterenv runs the single-env "
            "implementation in workers, exactly as vectorization_mode='sync' would."
        )
    raise ValueError(f"`vectorization_mode` must be 'sync', 'async', a gymnasium.VectorizeMode or None, got {mode!r}.")


def _tell_vector_entry_point_given_up(env_spec: EnvSpec, num_envs: Any) -> None:
    """Log, once per env id, that ``gymnasium.make_vec`` without a mode would have run the env's own vector env.

    A user who swaps ``gymnasium.make_vec(id, n)`` for this call trades an in-process numpy
    loop (about 3x ``SyncVectorEnv`` with 16 CartPoles, 10x with 64) for single envs in
    workers. Info, not a warning: the envs are exactly those of ``vectorization_mode="sync"``,
    as documented, and nothing needs fixing; the docs' CartPole examples would warn otherwise.
    """
    if env_spec.id in _TOLD_VECTOR_ENTRY_POINT:
        return
    _TOLD_VECTOR_ENTRY_POINT.add(env_spec.id)
    logger.info(
        "clusterenv.make_vec(%r, %s) steps %s single envs in worker processes, as vectorization_mode='sync' does. "
        "gymnasium.make_vec(%r, %s) without a mode makes the env's own vectorized implementation instead "
        "(vector_entry_point: %s), which steps them all at once in one process: for a cheap env, several times "
        "faster than single envs (other trajectories, too). To keep it, pass its vector envs as units: "
        "clusterenv.ClusterEnv([functools.partial(gymnasium.make_vec, %r, k, vectorization_mode='vector_entry_point')]"
        " * num_workers) (docs/guides/units.md).",
        env_spec.id,
        num_envs,
        num_envs,
        env_spec.id,
        num_envs,
        _entry_point_name(env_spec.vector_entry_point),
        env_spec.id,
    )


def _entry_point_name(entry_point: Any) -> str:
    """``module:Class`` for a string entry point or a class."""
    if isinstance(entry_point, str):
        return entry_point
    return f"{getattr(entry_point, '__module__', '?')}:{getattr(entry_point, '__qualname__', entry_point)}"


def _cluster_kwargs(vector_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``vector_kwargs`` as :class:`ClusterEnv` takes them: Sync's and Async's own arguments sorted out."""
    kwargs = dict(vector_kwargs or {})
    for name, reason in _UNSUPPORTED_KWARGS.items():
        if name in kwargs:
            raise ValueError(f"`vector_kwargs[{name!r}]` cannot be honoured: {reason}.")
    for name in _ASYNC_ONLY_KWARGS:
        if name in kwargs:
            logger.debug(
                "Ignoring AsyncVectorEnv's `%s=%r`: ClusterEnv runs the envs in its own workers.", name, kwargs[name]
            )
            del kwargs[name]
    return kwargs
