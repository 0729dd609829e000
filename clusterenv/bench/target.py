"""The env under test: a registered id or a ``module:function`` entry point, checked before anything starts.

Bad input ends the run with one line and exit status 2 (:class:`BenchInputError`), not a traceback:
the user typed a name wrong, which is not a bug to debug.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym

__all__ = ["BenchInputError", "EnvTarget", "resolve_target"]


class BenchInputError(ValueError):
    """The bench cannot run on this input (an unknown env id, an entry point that does not import, ...)."""


@dataclass(frozen=True)
class EnvTarget:
    """One env to benchmark.

    Attributes:
        name: how the report names it (the env id, or the entry point as given).
        env_id: the registered id, where there is one (EnvPool is asked by id); None for an entry point.
        make: a zero-argument callable making one env; picklable, since workers and subprocesses call it.
    """

    name: str
    env_id: str | None
    make: Callable[[], gym.Env]


def resolve_target(env_id: str | None, entry_point: str | None) -> EnvTarget:
    """The env named by exactly one of ``env_id`` and ``entry_point``, made once here to check it.

    Raises:
        BenchInputError: neither or both given, an id Gymnasium does not know, an entry point that
            does not import or is not callable, or an env that fails to build.
    """
    if (env_id is None) == (entry_point is None):
        raise BenchInputError("give an env id or `--entry-point module:function`, not both and not neither")
    if env_id is not None:
        target = EnvTarget(env_id, env_id, functools.partial(gym.make, env_id))
        try:
            gym.spec(env_id)
        except gym.error.Error as exc:
            raise BenchInputError(f"unknown env id `{env_id}`: {_one_line(exc)}") from exc
    else:
        assert entry_point is not None
        target = EnvTarget(entry_point, None, _entry_point(entry_point))
    try:
        env = target.make()
    except Exception as exc:
        raise BenchInputError(f"`{target.name}` could not be made: {type(exc).__name__}: {_one_line(exc)}") from exc
    if not isinstance(env, gym.Env):
        # Anything else may have no close() either (a str, or None from a factory missing its `return`).
        raise BenchInputError(f"`{target.name}` must return a `gymnasium.Env`, but it returned {_returned(env)}")
    try:
        for name in ("observation_space", "action_space"):
            space = getattr(env, name, None)
            if not isinstance(space, gym.spaces.Space):
                raise BenchInputError(
                    f"`{target.name}`'s `{name}` must be a `gymnasium.spaces.Space`, got {type(space).__name__}"
                )
    finally:
        env.close()
    return target


def _entry_point(entry_point: str) -> Callable[[], gym.Env]:
    """The callable ``module:function`` names, imported the way the workers will import it."""
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise BenchInputError(f"`--entry-point` must be `module:function`, got `{entry_point}`")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise BenchInputError(
            f"`--entry-point {entry_point}`: module `{module_name}` does not import: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise BenchInputError(f"`--entry-point {entry_point}`: `{module_name}` has no attribute `{attr}`")
        factory = getattr(factory, part)
    if not callable(factory):
        raise BenchInputError(f"`--entry-point {entry_point}`: expected a callable, got {type(factory).__name__}")
    return factory


def _returned(value: object) -> str:
    """What a factory returned, for the error: its type, and its value where that is short."""
    if value is None:
        return "None (does the factory miss a `return`?)"
    text = repr(value)
    return f"a {type(value).__name__} ({text})" if len(text) <= 60 else f"a {type(value).__name__}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
