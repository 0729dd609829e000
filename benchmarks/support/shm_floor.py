"""The floor of a one-host step path: a bare shared-memory lockstep loop (benchmark-only, never the library).

One shared array per field (actions in; observations, rewards, terminations, truncations
and fixed-key infos with their masks out), one byte on a pipe per worker each way, forked
workers each stepping its slice as a ``SyncVectorEnv`` (NEXT_STEP), both sides blocking on
the pipe (no spinning), and ``copy=True`` results. Nothing else: no framing, no MACs, no
liveness, no recovery. It is what this machine allows any Python step path of that shape,
so ``onehost.py`` times clusterenv against it in the same run.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

_STEP, _RESET, _QUIT = b"s", b"r", b"q"


class _Region:
    """Named arrays in one anonymous shared mapping, made before the workers fork (so they share it)."""

    def __init__(self, fields: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        sizes = {name: int(np.prod(shape)) * np.dtype(dtype).itemsize for name, (shape, dtype) in fields.items()}
        offsets, total = {}, 0
        for name, size in sizes.items():
            offsets[name], total = total, total + -(-size // 64) * 64  # each field on its own cache line
        self._map = mmap.mmap(-1, max(total, 64))
        self.arrays = {
            name: np.ndarray(shape, dtype, buffer=self._map, offset=offsets[name])
            for name, (shape, dtype) in fields.items()
        }


class ShmFloor:
    """Lockstep ``reset``/``step`` over forked workers and a shared region, exact against ``SyncVectorEnv``.

    Args:
        env_fns: the env factories.
        num_workers: forked worker processes; worker ``w`` steps a contiguous slice of the envs.
        info_keys: the info keys (in the order the envs report them) whose scalar values travel in
            the region; any other info is dropped, so exactness holds for envs whose infos are these.
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]], num_workers: int, info_keys: Sequence[str] = ()):
        self.num_envs = n = len(env_fns)
        probe = env_fns[0]()
        obs_space, act_space = probe.observation_space, probe.action_space
        self.info_keys = list(info_keys)
        # Each info key's dtype as SyncVectorEnv batches it (the type of the env's value), learned from one step.
        probe.reset(seed=0)
        step_info = probe.step(act_space.sample())[4]
        info_dtypes = {key: np.dtype(type(step_info[key])) for key in self.info_keys}
        probe.close()
        fields: dict[str, tuple[tuple[int, ...], Any]] = {
            "actions": ((n, *act_space.shape), act_space.dtype),
            "obs": ((n, *obs_space.shape), obs_space.dtype),
            "rewards": ((n,), np.float64),
            "terminations": ((n,), np.bool_),
            "truncations": ((n,), np.bool_),
            "seeds": ((n,), np.int64),
        }
        for key in self.info_keys:
            fields[f"info:{key}"] = ((n,), info_dtypes[key])
            fields[f"mask:{key}"] = ((n,), np.bool_)
        self._region = _Region(fields)
        self._a = self._region.arrays
        bounds = np.linspace(0, n, num_workers + 1).astype(int)
        self._slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self._pids: list[int] = []
        self._to: list[int] = []  # the learner's write ends, one per worker
        self._from: list[int] = []  # the learner's read ends
        for sl in self._slices:
            command_r, command_w = os.pipe()
            reply_r, reply_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the worker: it never returns
                os.close(command_w)
                os.close(reply_r)
                self._serve(list(env_fns[sl]), sl, command_r, reply_w)
            os.close(command_r)
            os.close(reply_w)
            self._pids.append(pid)
            self._to.append(command_w)
            self._from.append(reply_r)

    def _serve(self, fns: list[Callable[[], gym.Env]], sl: slice, command_r: int, reply_w: int) -> None:
        code = 0
        try:
            envs = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.NEXT_STEP)
            a = self._a
            while (command := os.read(command_r, 1)) != _QUIT:
                if command == _RESET:
                    obs, infos = envs.reset(seed=[int(s) for s in a["seeds"][sl]])
                    a["rewards"][sl], a["terminations"][sl], a["truncations"][sl] = 0.0, False, False
                else:
                    obs, rewards, terminations, truncations, infos = envs.step(a["actions"][sl])
                    a["rewards"][sl], a["terminations"][sl], a["truncations"][sl] = rewards, terminations, truncations
                a["obs"][sl] = obs
                for key in self.info_keys:
                    present = infos.get(f"_{key}")
                    a[f"mask:{key}"][sl] = False if present is None else present
                    if present is not None:
                        a[f"info:{key}"][sl] = infos[key]
                os.write(reply_w, b"d")
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    def _round(self, command: bytes) -> None:
        for fd in self._to:
            os.write(fd, command)
        for fd in self._from:
            if os.read(fd, 1) != b"d":
                raise RuntimeError("A floor worker died.")

    def _infos(self) -> dict[str, Any]:
        infos: dict[str, Any] = {}
        for key in self.info_keys:
            mask = self._a[f"mask:{key}"]
            if mask.any():
                values = self._a[f"info:{key}"]
                infos[key] = np.where(mask, values, np.zeros((), values.dtype))
                infos[f"_{key}"] = mask.copy()
        return infos

    def reset(self, seed: int) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset env ``i`` with ``seed + i``, as ``SyncVectorEnv.reset(seed=seed)`` does."""
        self._a["seeds"][:] = np.arange(seed, seed + self.num_envs)
        self._round(_RESET)
        return self._a["obs"].copy(), self._infos()

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env; fresh arrays, as ``copy=True`` returns them."""
        self._a["actions"][:] = actions
        self._round(_STEP)
        a = self._a
        return a["obs"].copy(), a["rewards"].copy(), a["terminations"].copy(), a["truncations"].copy(), self._infos()

    def close(self) -> None:
        """End the workers."""
        for fd in self._to:
            try:
                os.write(fd, _QUIT)
            except OSError:
                pass
            os.close(fd)
        for fd in self._from:
            os.close(fd)
        for pid in self._pids:
            os.waitpid(pid, 0)
        self._pids = []
