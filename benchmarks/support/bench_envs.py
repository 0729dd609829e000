"""Env factories for the benchmarks, importable by any worker process (no clusterenv imports).

``BurnEnv`` is a synthetic environment whose ``step`` burns a fixed amount of CPU time. It stands in for an expensive simulator: each step spins until this thread has used
``step_cpu_ms`` of CPU (thread CPU time, not wall time, so that a step that is preempted
by another process still costs the full amount of work). Kept free of clusterenv imports
so that workers, ``AsyncVectorEnv`` subprocesses and ``SyncVectorEnv`` all run the same code.

``SleepEnv`` sleeps instead: a step that takes wall time but no CPU, so that what a
benchmark measures is the cost of moving steps around, not of making them.

``make_atari`` registers ale-py's envs first: a fresh worker process has not imported it.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["BurnEnv", "FrameReplayEnv", "NullEnv", "SleepEnv", "TracedBurnEnv", "make_atari", "record_breakout"]


class BurnEnv(gym.Env):
    """Observations are 4 floats, actions ``Discrete(2)``; episodes last ``episode_steps`` steps."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_cpu_ms: float = 1.0, episode_steps: int = 200) -> None:
        self.step_cpu_s = step_cpu_ms / 1000.0
        self.episode_steps = episode_steps
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(-1.0, 1.0, size=4).astype(np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        end = time.thread_time() + self.step_cpu_s
        while time.thread_time() < end:
            pass
        self._t += 1
        obs = self.np_random.uniform(-1.0, 1.0, size=4).astype(np.float32)
        return obs, float(action), self._t >= self.episode_steps, False, {}


class SleepEnv(gym.Env):
    """A step that waits ``step_ms`` without using CPU, like a remote simulator or an env on another host.

    Observations are 4 floats (the last action), actions ``Discrete(2)``; no infos, no episode end.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_ms: float = 20.0, jitter_sigma: float = 0.0) -> None:
        self.step_s = step_ms / 1000.0
        self.jitter_sigma = jitter_sigma  # lognormal: a few steps take several times the mean (stragglers)
        self._jitter = np.random.default_rng()  # unseeded: timing must not change the env's results
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        delay = self.step_s
        if self.jitter_sigma:
            sigma = self.jitter_sigma  # mean-preserving: E[lognormal(mu, sigma)] = step_s
            delay = float(self._jitter.lognormal(np.log(self.step_s) - sigma**2 / 2, sigma))
        time.sleep(delay)
        return np.full(4, float(action), dtype=np.float32), 1.0, False, False, {}


def make_atari(env_id: str, **kwargs: Any) -> gym.Env:
    """``gym.make(env_id)`` for an ale-py id such as ``ALE/Pong-v5``, in any process."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make(env_id, **kwargs)


class FrameReplayEnv(gym.Env):
    """Replays recorded 84x84x4 uint8 frame stacks (``record_breakout``), starting at ``offset``: no CPU per step.

    Real frames, so that what compression does to them is what it does to a game's; episodes never end.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, path: str, offset: int = 0) -> None:
        self._frames = np.load(path, mmap_mode="r")
        self.observation_space = gym.spaces.Box(0, 255, shape=self._frames.shape[1:], dtype=np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self._t = offset

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.asarray(self._frames[self._t % len(self._frames)]), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        return np.asarray(self._frames[self._t % len(self._frames)]), 0.0, False, False, {}


def record_breakout(path: str, steps: int = 512, seed: int = 0) -> None:
    """Write ``steps`` observations of Breakout, preprocessed and stacked as CleanRL's PPO sees them, to ``path`` (.npy)."""
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = FrameStackObservation(AtariPreprocessing(gym.make("ALE/Breakout-v5", frameskip=1), frame_skip=4), 4)
    env.action_space.seed(seed)
    obs, _ = env.reset(seed=seed)
    frames = []
    for _ in range(steps):
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        frames.append(obs)
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    np.save(path, np.stack(frames))


class NullEnv(gym.Env):
    """Does nothing: the same 4-float observation every step, so a batch step is all transport and bookkeeping."""

    metadata: dict[str, Any] = {"render_modes": []}
    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(4,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)
    _obs = np.zeros(4, dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        return self._obs, 0.0, False, False, {}


class TracedBurnEnv(BurnEnv):
    """A ``BurnEnv`` that records when each of its steps started and ended (``time.monotonic_ns``, one clock per host).

    On ``close`` it writes them to ``<trace_dir>/<pid>-<id>.npy`` as an ``(steps, 2)`` array, so
    that a benchmark can line up, per batch step, when each worker began and finished its envs.
    """

    def __init__(self, trace_dir: str, step_cpu_ms: float = 1.0) -> None:
        super().__init__(step_cpu_ms, episode_steps=10**9)
        self.trace_dir = trace_dir
        self._steps: list[tuple[int, int]] = []

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        started = time.monotonic_ns()
        result = super().step(action)
        self._steps.append((started, time.monotonic_ns()))
        return result

    def close(self) -> None:
        import os

        if self._steps:
            np.save(f"{self.trace_dir}/{os.getpid()}-{id(self)}.npy", np.array(self._steps, np.int64))
            self._steps = []
