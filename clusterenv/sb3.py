"""Stable-Baselines3 adapter: :class:`ClusterVecEnv`, a ``VecEnv`` whose envs run in clusterenv workers.

Swap one line of a Stable-Baselines3 script (``pip install "clusterenv-rl[sb3]"``)::

    from clusterenv.sb3 import ClusterVecEnv

    env = ClusterVecEnv([make_env(i) for i in range(8)])  # was SubprocVecEnv([...])
    model = PPO("MlpPolicy", env).learn(100_000)

It is a third implementation of SB3's ``VecEnv`` contract beside ``DummyVecEnv`` and
``SubprocVecEnv``, so SB3's wrappers (``VecNormalize``, ``VecFrameStack``, ``VecMonitor``,
``VecVideoRecorder``) stack on it. Underneath is a :class:`~clusterenv.ClusterEnv` in
``SAME_STEP`` autoreset mode, whose per-env results are turned into SB3's: ``dones``,
float32 rewards, per-env ``infos`` with ``"terminal_observation"`` and
``"TimeLimit.truncated"``, and ``reset_infos``. With the same seeds and actions it returns
what ``DummyVecEnv`` returns.

Envs are reset by SB3's rule, not Gymnasium's: ``options=`` only for an env that
``set_options`` gave options, and an autoreset with no arguments at all. So envs written
before Gymnasium 0.26 added ``options`` (``def reset(self, seed=None)``) train here as on
``SubprocVecEnv``.
"""

from __future__ import annotations

import multiprocessing
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from stable_baselines3.common.env_util import is_wrapped
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
from stable_baselines3.common.vec_env.patch_gym import _patch_env

from clusterenv.learner.vector_env import ClusterEnv
from clusterenv.wire.layers import Layer
from clusterenv.wire.leaves import batch_of_items

__all__ = ["ClusterVecEnv"]

# SAME_STEP's record of an ended episode, which SB3 reports as its step info and its terminal observation.
_FINAL_OBS, _FINAL_INFO = "final_obs", "final_info"


class ClusterVecEnv(VecEnv):
    """A Stable-Baselines3 ``VecEnv`` over a :class:`~clusterenv.ClusterEnv`: ``SubprocVecEnv`` with clusterenv workers.

    Args:
        env_fns: zero-argument callables creating the environments, as for ``SubprocVecEnv``; or
            vector envs in ``SAME_STEP`` autoreset mode (units, docs/guides/units.md), such as
            SuperSuit's copies of a PettingZoo game: their per-env infos at an episode's end
            (``"terminal_observation"``) are passed on as they are, as SuperSuit's SB3 wrapper does.
        start_method: ``SubprocVecEnv``'s multiprocessing start method: checked the same
            way, then unused (clusterenv starts its own workers; see ``launcher``).
        **cluster_kwargs: :class:`~clusterenv.ClusterEnv`'s arguments (``num_workers``,
            ``launcher``, ``secret``, ...), except ``autoreset_mode``: SB3 resets an ended
            episode within the step (``SAME_STEP``).

    Examples:
        >>> from stable_baselines3.common.env_util import make_vec_env
        >>> from clusterenv.sb3 import ClusterVecEnv
        >>> env = make_vec_env("CartPole-v1", n_envs=4, vec_env_cls=ClusterVecEnv)
        >>> env.seed(0)
        [0, 1, 2, 3]
        >>> env.reset().shape
        (4, 4)
        >>> env.close()
    """

    def __init__(
        self, env_fns: Sequence[Callable[[], gym.Env]], start_method: str | None = None, **cluster_kwargs: Any
    ):
        if start_method is not None:
            multiprocessing.get_context(start_method)  # a ValueError for an unknown method, as SubprocVecEnv raises
        if "autoreset_mode" in cluster_kwargs:
            raise ValueError(
                "ClusterVecEnv sets `autoreset_mode` itself: Stable-Baselines3 resets an ended episode within the step "
                f"(SAME_STEP), got autoreset_mode={cluster_kwargs['autoreset_mode']!r}."
            )
        self.cluster_env = ClusterEnv(
            [_Patched(fn) for fn in env_fns], autoreset_mode=AutoresetMode.SAME_STEP, **cluster_kwargs
        )
        try:
            super().__init__(
                self.cluster_env.num_envs,
                self.cluster_env.single_observation_space,
                self.cluster_env.single_action_space,
            )
        except BaseException:
            self.cluster_env.close(terminate=True)
            raise

    # -- stepping --------------------------------------------------------------------------
    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds of :meth:`seed` and the options of :meth:`set_options`, then forget them."""
        options = [env_options or None for env_options in self._options]
        obs, infos = self.cluster_env.reset(
            seed=list(self._seeds), options=options if any(o is not None for o in options) else None
        )
        self.reset_infos = _per_env(infos, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        """Send one action per env to the workers.

        SB3 indexes ``actions`` by env (``actions[i]`` is env ``i``'s action, a list of dicts
        for a ``Dict`` space); Gymnasium batches per key. An array is both; anything else is
        rebatched, each env still receiving its own action's values.
        """
        if not isinstance(actions, np.ndarray):
            actions = batch_of_items(self.cluster_env.action_space, list(actions))
        self.cluster_env.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        """``(obs, rewards, dones, infos)`` as SB3 has them: an ended episode's next observation is the reset one."""
        obs, rewards, terminations, truncations, batched_infos = self.cluster_env.step_wait()
        dones = np.logical_or(terminations, truncations)
        infos = []
        for i, info in enumerate(_per_env(batched_infos, self.num_envs)):
            if dones[i] and _FINAL_OBS not in info:
                # A unit that resets its own envs (SuperSuit's copies of a game) and reports SB3's own
                # infos ("terminal_observation"): passed on as they are, as SuperSuit's SB3 wrapper does.
                infos.append(info)
                continue
            if dones[i]:
                final_obs, step_info = info.pop(_FINAL_OBS), info.pop(_FINAL_INFO)
                self.reset_infos[i] = info  # what is left is the reset's info
                info = dict(step_info)
            info["TimeLimit.truncated"] = bool(truncations[i] and not terminations[i])
            if dones[i]:
                info["terminal_observation"] = final_obs
            infos.append(info)
        return obs, rewards.astype(np.float32), dones, infos

    def close(self) -> None:
        """Close the envs and end the workers."""
        self.cluster_env.close()

    # -- the envs' attributes --------------------------------------------------------------
    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's ``render()``, when the render mode is ``"rgb_array"``."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images.",
                stacklevel=2,
            )
            return [None for _ in range(self.num_envs)]
        return list(self.cluster_env.render() or ())

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """Attribute ``attr_name`` of each env (``get_wrapper_attr``); an ``AttributeError`` if one lacks it."""
        return list(self.cluster_env.apply(lambda env: env.get_wrapper_attr(attr_name), self._targets(indices)))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set ``attr_name`` to ``value`` on each env's outermost wrapper, as ``SubprocVecEnv`` does."""
        self.cluster_env.apply(lambda env: setattr(env, attr_name, value), self._targets(indices))

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        """Call method ``method_name`` of each env with the arguments; the results."""
        return list(
            self.cluster_env.apply(
                lambda env: env.get_wrapper_attr(method_name)(*method_args, **method_kwargs),
                self._targets(indices),
            )
        )

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        """Whether each env is wrapped in ``wrapper_class`` (SB3's ``is_wrapped``, run where the env lives)."""
        return list(self.cluster_env.apply(lambda env: is_wrapped(env, wrapper_class), self._targets(indices)))

    def _targets(self, indices: VecEnvIndices) -> list[int]:
        return list(self._get_indices(indices))

    def __repr__(self) -> str:
        return f"ClusterVecEnv({self.cluster_env!r})"


class _Patched:
    """An env factory whose env passes through SB3's ``_patch_env`` (old ``gym`` envs), as in ``SubprocVecEnv``.

    The env is then reset by SB3's rule (:class:`_SB3Reset`).
    """

    def __init__(self, env_fn: Callable[[], Any]) -> None:
        self.env_fn = env_fn

    def __call__(self) -> gym.Env | VectorEnv:
        env = self.env_fn()
        if isinstance(env, VectorEnv):  # a unit (docs/guides/units.md): it resets its own envs
            return env
        return _SB3Reset(_patch_env(env))


class _SB3Reset(Layer):
    """Resets the env as SB3's VecEnvs do: ``options=`` only when there are options for it.

    ``DummyVecEnv`` and ``SubprocVecEnv`` call ``env.reset(seed=seed, **maybe_options)``, and
    ``env.reset()`` to autoreset; Gymnasium's ``SyncVectorEnv``, which steps the envs in the
    workers, passes ``options=None`` every time, which an env whose ``reset`` takes no
    ``options`` refuses. ``apply``, and so the adapter's attribute methods, look past this layer.
    """

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        if not kwargs.get("options"):
            kwargs.pop("options", None)
        return self.env.reset(**kwargs)


def _per_env(batched: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Gymnasium's batched infos back to one dict per env (a key is in env ``i``'s dict where ``_key`` is set)."""
    infos: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in batched.items():
        if key.startswith("_") and key[1:] in batched:
            continue  # a mask
        mask = batched.get(f"_{key}")
        nested = _per_env(value, num_envs) if isinstance(value, dict) else None
        for i in range(num_envs):
            if mask is None or mask[i]:
                infos[i][key] = nested[i] if nested is not None else value[i]
    return infos
