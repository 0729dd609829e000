"""clusterenv's own wrappers around a user's env, which ``apply`` and attribute calls look past.

clusterenv wraps an env where it must change how the env is called: the Stable-Baselines3
adapter resets it by SB3's rule (``clusterenv.sb3``), and ``on_env_error="reset"`` catches its
errors (``stepping/env_errors.py``). Such a wrapper is a :class:`Layer`: ``ClusterEnv.apply`` hands
functions the env inside every layer (:func:`user_env`), and attributes set on it go to that env,
so user code sees the env as its factory made it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

__all__ = ["Layer", "user_env"]


class Layer(gym.Wrapper):
    """A wrapper of clusterenv's own: invisible to ``apply`` and to attributes set on the env."""

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        """Set on the env inside, as without this layer."""
        return self.env.set_wrapper_attr(name, value, force=force)


def user_env(env: Any) -> Any:
    """The env as its factory made it: ``env`` inside every :class:`Layer` around it."""
    while isinstance(env, Layer):
        env = env.env
    return env
