"""``ClusterEnv(on_env_error="reset")``: an env that raises ends only its own episode, and is rebuilt.

Worker side. Each env of the worker's slice is wrapped in a :class:`ResettingEnv`. When the
env's ``step`` raises, the wrapper answers that step itself, as the end of a truncated
episode: the last observation again, reward 0, ``terminated=False``, ``truncated=True``,
and ``info["env_error"]`` (the exception's type, message and traceback). Gymnasium's own
autoreset then resets the env (in the same step under SAME_STEP, in the next one under
NEXT_STEP), and that reset first rebuilds it from its factory: a simulator that crashed is
not trusted to reset. A ``reset`` that raises is retried once on a rebuilt env, with the
error in that reset's info. The other envs never see any of it.

An env may raise at most ``max_errors`` times within :data:`ERROR_WINDOW_STEPS` of its own
steps; one more error is raised as under ``on_env_error="raise"``, and so is a factory that
raises :data:`REBUILD_ATTEMPTS` times in a row.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from clusterenv.stepping.failures import describe_exception
from clusterenv.wire.layers import Layer

__all__ = ["ENV_ERROR_KEY", "ERROR_WINDOW_STEPS", "REBUILD_ATTEMPTS", "ResettingEnv"]

logger = logging.getLogger(__name__)

#: The info key (with its ``_`` mask) of a step or reset that an env's error ended.
ENV_ERROR_KEY = "env_error"
#: ``max_env_errors`` counts one env's errors over its last this many steps.
ERROR_WINDOW_STEPS = 1000
#: A factory that raises this many times in a row while an env is rebuilt is an error of its own.
REBUILD_ATTEMPTS = 3


def _describe(exc: BaseException) -> dict[str, str]:
    """What ``info["env_error"]`` says of an exception just caught (cut as an error reply is)."""
    exc_type, message, formatted = describe_exception(exc)
    return {"type": exc_type, "message": message, "traceback": formatted}


class ResettingEnv(Layer):
    """An env whose errors end its episode instead of the run (see the module's docstring).

    Args:
        env: the env, as its factory made it.
        factory: makes it anew.
        max_errors: the most errors within :data:`ERROR_WINDOW_STEPS` of its steps.
    """

    def __init__(self, env: gym.Env, factory: Callable[[], gym.Env], max_errors: int) -> None:
        super().__init__(env)
        self._factory = factory
        self._max_errors = max_errors
        self._steps = 0
        self._errors: collections.deque[int] = collections.deque()  # the step counts at which it raised
        self._broken = False
        self._last_obs: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Reset, rebuilding the env first if it raised; a reset that raises is retried once on a rebuilt env."""
        if self._broken:
            self._rebuild()
        try:
            obs, info = self.env.reset(**kwargs)
        except Exception as exc:
            self._count(exc)
            error = _describe(exc)
            self._rebuild()
            obs, info = self.env.reset(**kwargs)
            info = {**info, ENV_ERROR_KEY: error}
        self._last_obs = obs
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """Step; if the env raises, end its episode here (truncated, reward 0, the last observation)."""
        self._steps += 1
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except Exception as exc:
            self._count(exc)
            self._broken = True
            logger.debug("An env raised %s; its episode ends and it is rebuilt.", type(exc).__name__)
            return self._last_obs, 0.0, False, True, {ENV_ERROR_KEY: _describe(exc)}
        self._last_obs = obs
        return obs, reward, terminated, truncated, info

    def _count(self, exc: BaseException) -> None:
        """Count an error (being handled); past the bound, raise it again as it was."""
        while self._errors and self._errors[0] <= self._steps - ERROR_WINDOW_STEPS:
            self._errors.popleft()
        self._errors.append(self._steps)
        if len(self._errors) > self._max_errors:
            raise exc

    def _rebuild(self) -> None:
        with contextlib.suppress(Exception):  # a crashed simulator may not close cleanly
            self.env.close()
        for attempt in range(1, REBUILD_ATTEMPTS + 1):
            try:
                self.env = self._factory()
                break
            except Exception as exc:
                if attempt == REBUILD_ATTEMPTS:
                    raise RuntimeError(
                        f"The env's factory raised {REBUILD_ATTEMPTS} times in a row while the env was rebuilt "
                        f"after an error (on_env_error='reset'); the last time {type(exc).__name__}: {exc}"
                    ) from exc
        self._broken = False
