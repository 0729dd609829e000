"""``SyncVectorEnv.step``'s loop for ``NEXT_STEP`` and ``SAME_STEP`` autoreset, without its per-env bookkeeping.

On envs whose step costs a µs or two (a null env, a cheap grid world) half of
``SyncVectorEnv.step`` is its own bookkeeping: comparing the autoreset mode (an enum) three
times per env, calling ``_add_info`` for every env (and building the info dict) even when the
env returned none, copying the results. This loop does what it does, state for state: the
same calls to each env in the same order, the same writes to the same arrays (each one
element by element, so a value that would not fit raises as there), the same observations
batched by Gymnasium's own ``concatenate``; infos are recorded per env, as
:class:`~clusterenv.stepping.recording_env.RecordingVectorEnv` records them. Only where the
actions are one array (``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary``), which
Gymnasium's ``iterate`` walks row by row as Python's ``for`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import concatenate

__all__ = ["ARRAY_ACTIONS", "batch_observations", "lean_step", "takes_lean_step"]

#: Action spaces whose batch is one array that ``iterate`` walks row by row.
ARRAY_ACTIONS = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
_LEAN_MODES = (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP)


def takes_lean_step(vector: SyncVectorEnv, actions: Any) -> bool:
    """Whether :func:`lean_step` steps ``vector`` with ``actions`` as ``SyncVectorEnv.step`` would."""
    return (
        vector.autoreset_mode in _LEAN_MODES
        and type(actions) is np.ndarray
        and isinstance(vector.action_space, ARRAY_ACTIONS)
        and len(actions) == vector.num_envs
    )


def lean_step(vector: Any, envs: list[Any], actions: np.ndarray, info_log: list[Any]) -> None:
    """Step ``envs`` (``vector``'s, as a plain list) with ``actions``; infos to ``info_log``, env by env.

    Under ``NEXT_STEP`` an env that ended last step is reset instead (reward 0, both flags
    false); under ``SAME_STEP`` an env that ends is reset within the step, its last observation
    and info recorded as ``final_obs`` and ``final_info`` first, as ``SyncVectorEnv`` adds them.

    Leaves the results where ``SyncVectorEnv.step`` leaves them (``vector._observations``,
    ``_rewards``, ``_terminations``, ``_truncations``, ``_autoreset_envs``) and returns nothing:
    the caller returns them as ``copy=False`` would. The loop variable is ``i``, as in
    ``SyncVectorEnv.step``, so that an env's exception is named by its index
    (:func:`~clusterenv.stepping.failures.index_in_step`).
    """
    env_obs, rewards = vector._env_obs, vector._rewards
    terminations, truncations = vector._terminations, vector._truncations
    if vector.autoreset_mode is AutoresetMode.NEXT_STEP:
        autoresetting = vector._autoreset_envs.tolist()
        for i in range(len(envs)):
            if autoresetting[i]:
                env_obs[i], env_info = envs[i].reset()
                rewards[i] = 0.0
                terminations[i] = False
                truncations[i] = False
            else:
                env_obs[i], rewards[i], terminations[i], truncations[i], env_info = envs[i].step(actions[i])
            if env_info:
                info_log.append((i, env_info))
    else:
        for i in range(len(envs)):
            env_obs[i], rewards[i], terminations[i], truncations[i], env_info = envs[i].step(actions[i])
            if terminations[i] or truncations[i]:
                info_log.append((i, {"final_obs": env_obs[i], "final_info": env_info}))
                env_obs[i], env_info = envs[i].reset()
            if env_info:
                info_log.append((i, env_info))
    vector._observations = batch_observations(vector.single_observation_space, env_obs, vector._observations)
    vector._autoreset_envs = np.logical_or(terminations, truncations)


def batch_observations(space: spaces.Space, env_obs: list[Any], out: Any) -> Any:
    """Gymnasium's ``concatenate(space, env_obs, out)``, row by row where that is the same.

    For a ``Box`` it is ``np.stack(env_obs, out=out)`` (3.7 µs for 8 rows of 4 floats); where
    every observation is an array of the batch's own dtype and a row's shape, writing the rows
    one by one stores the same values and raises nothing either (0.9 µs). Anything else (a
    list, another dtype, another shape) goes to ``concatenate``, which casts or raises as it does.
    """
    if type(space) is spaces.Box and type(out) is np.ndarray:
        dtype, shape = out.dtype, out.shape[1:]
        for obs in env_obs:
            if type(obs) is not np.ndarray or obs.dtype is not dtype or obs.shape != shape:
                break
        else:
            for i, obs in enumerate(env_obs):
                out[i] = obs
            return out
    return concatenate(space, env_obs, out)
