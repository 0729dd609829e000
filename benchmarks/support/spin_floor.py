"""The floor of a spinning split (benchmark-only, never the library): what no process wake-up costs.

The learner steps the first half of the envs itself and one forked worker the other half,
each as a ``SyncVectorEnv`` (NEXT_STEP). Actions, observations, rewards and flags live in
one shared mapping; a step is the learner writing the worker's actions and bumping a
sequence word, stepping its own half, then reading the worker's sequence word in a loop
until it matches. The worker reads the learner's word in a loop too: nobody ever blocks or
makes a system call, and infos are dropped. It is what a step of this shape costs on this
machine without a single wake-up, so ``onehost.py`` times clusterenv's
``learner_envs``/``spin_us`` against it, and checks it exact against ``SyncVectorEnv``
(CartPole-v1, which reports no infos).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

_STEP, _RESET, _QUIT = 1, 2, 3


class SpinFloor:
    """Lockstep ``reset``/``step`` split between the learner and one forked worker, both spinning.

    Args:
        env_fns: the env factories; the learner steps the first ``len // 2``, the worker the rest.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], info_keys: Sequence[str] = ()) -> None:
        self.num_envs = n = len(env_fns)
        self.half = half = n // 2
        probe = env_fns[0]()
        obs_space, act_space = probe.observation_space, probe.action_space
        probe.close()
        fields: dict[str, tuple[tuple[int, ...], Any]] = {
            "words": ((3,), np.uint64),  # [command sequence, command kind, done sequence]
            "actions": ((n, *act_space.shape), act_space.dtype),
            "obs": ((n, *obs_space.shape), obs_space.dtype),
            "rewards": ((n,), np.float64),
            "terminations": ((n,), np.bool_),
            "truncations": ((n,), np.bool_),
            "seeds": ((n,), np.int64),
        }
        offsets, total = {}, 0
        for name, (shape, dtype) in fields.items():
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            offsets[name], total = total, total + -(-max(size, 1) // 64) * 64
        self._map = mmap.mmap(-1, total)
        self._a = {name: np.ndarray(s, d, buffer=self._map, offset=offsets[name]) for name, (s, d) in fields.items()}
        self._words = memoryview(self._map)[: 3 * 8].cast("Q")  # a memoryview's reads cost a fraction of numpy's
        self._seq = 0
        self._pid = os.fork()
        if self._pid == 0:  # the worker: it never returns
            self._serve(list(env_fns[half:]), slice(half, n))
        self._own = SyncVectorEnv(list(env_fns[:half]), autoreset_mode=AutoresetMode.NEXT_STEP)

    def _serve(self, fns: list[Callable[[], gym.Env]], sl: slice) -> None:
        code = 0
        try:
            envs = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP)
            a, words, seen = self._a, self._words, 0
            while True:
                while words[0] == seen:
                    pass
                seen = words[0]
                if words[1] == _QUIT:
                    break
                if words[1] == _RESET:
                    obs, _ = envs.reset(seed=[int(s) for s in a["seeds"][sl]])
                    a["rewards"][sl], a["terminations"][sl], a["truncations"][sl] = 0.0, False, False
                else:
                    obs, r, te, tr, _ = envs.step(a["actions"][sl].copy())
                    a["rewards"][sl], a["terminations"][sl], a["truncations"][sl] = r, te, tr
                a["obs"][sl] = obs
                words[2] = seen
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    def _command(self, kind: int) -> None:
        self._seq += 1
        self._words[1] = kind
        self._words[0] = self._seq

    def _await(self) -> None:
        words, seq = self._words, self._seq
        while words[2] != seq:
            pass

    def reset(self, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
        a, half = self._a, self.half
        a["seeds"][:] = np.arange(seed, seed + self.num_envs)
        self._command(_RESET)
        obs, _ = self._own.reset(seed=list(range(seed, seed + half)))
        a["obs"][:half] = obs
        a["rewards"][:half], a["terminations"][:half], a["truncations"][:half] = 0.0, False, False
        self._await()
        return a["obs"].copy(), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        a, half = self._a, self.half
        a["actions"][half:] = actions[half:]
        self._command(_STEP)
        obs, r, te, tr, _ = self._own.step(actions[:half])
        a["obs"][:half], a["rewards"][:half], a["terminations"][:half], a["truncations"][:half] = obs, r, te, tr
        self._await()
        return a["obs"].copy(), a["rewards"].copy(), a["terminations"].copy(), a["truncations"].copy(), {}

    def close(self) -> None:
        self._command(_QUIT)
        os.waitpid(self._pid, 0)
        self._own.close()
