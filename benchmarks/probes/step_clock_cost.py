"""What timing each env step costs a worker: ``RecordingVectorEnv.step`` with and without its step clock.

In one process, no messages: 4 envs (CartPole, ``NullEnv``) stepped 5,000 times, best of 7 repeats,
with the clock (as workers run) and with ``SyncVectorEnv``'s own ``step`` (no clock).

    python benchmarks/probes/step_clock_cost.py
"""

from __future__ import annotations

import sys
import timeit
from pathlib import Path

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv

# This folder, then benchmarks/ (support.bench_envs, support.report): the workers inherit the path.
sys.path[:0] = [str(folder) for folder in Path(__file__).resolve().parents[:2]]
from support.bench_envs import NullEnv  # noqa: E402

from clusterenv.stepping.failures import EnvTracker  # noqa: E402
from clusterenv.stepping.recording_env import build  # noqa: E402


def per_step_us(env_fn: object, timed: bool) -> float:
    envs = build([cloudpickle.dumps(env_fn)] * 4, "same", AutoresetMode.NEXT_STEP, EnvTracker())
    envs.reset(seed=0)
    step = envs.step if timed else (lambda actions: SyncVectorEnv.step(envs, actions))
    actions = np.zeros(4, np.int64)
    return min(timeit.repeat(lambda: step(actions), number=5000, repeat=7)) / 5000 * 1e6


if __name__ == "__main__":
    for name, env_fn in (("CartPole-v1", lambda: gym.make("CartPole-v1")), ("NullEnv", NullEnv)):
        without, with_clock = per_step_us(env_fn, False), per_step_us(env_fn, True)
        print(f"{name} x4: {without:.2f} µs per worker step without the clock, {with_clock:.2f} with it")
