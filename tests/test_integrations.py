"""skrl and TorchRL take a ClusterEnv where they take a Gymnasium vector env, and see the same data."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


def test_skrl_sees_what_it_sees_on_sync_vector_env():
    wrappers = pytest.importorskip("skrl.envs.wrappers.torch")

    def run(vector_env: gym.vector.VectorEnv) -> list[torch.Tensor]:
        env = wrappers.wrap_env(vector_env, wrapper="gymnasium")
        generator = torch.Generator().manual_seed(0)
        seen = []
        try:
            env._seed = 0  # skrl reads its first reset's seed from here (its set in the trainer)
            observation, _ = env.reset()
            seen.append(observation)
            for _ in range(300):
                actions = torch.randint(0, 2, (env.num_envs, 1), generator=generator)
                observation, reward, terminated, truncated, _ = env.step(actions)
                seen += [observation, reward, terminated, truncated]
        finally:
            env.close()
        return seen

    reference = run(SyncVectorEnv([CARTPOLE] * 4))
    candidate = run(ClusterEnv([CARTPOLE] * 4, num_workers=2))
    assert len(reference) == len(candidate)
    for want, got in zip(reference, candidate, strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED], ids=lambda m: m.value)
def test_torchrl_collects_what_it_collects_on_sync_vector_env(mode):
    """TorchRL's GymWrapper refuses NEXT_STEP autoreset: pass SAME_STEP (or DISABLED)."""
    pytest.importorskip("torchrl")
    from torchrl.collectors import Collector
    from torchrl.envs import GymWrapper

    def run(vector_env: gym.vector.VectorEnv) -> list:
        env = GymWrapper(vector_env)
        env.set_seed(0)
        torch.manual_seed(0)
        collector = Collector(env, policy=None, frames_per_batch=64, total_frames=320)
        try:
            return [batch.clone() for batch in collector]
        finally:
            collector.shutdown()
            env.close()

    reference = run(SyncVectorEnv([CARTPOLE] * 4, autoreset_mode=mode))
    candidate = run(ClusterEnv([CARTPOLE] * 4, num_workers=2, autoreset_mode=mode))
    assert len(reference) == len(candidate) == 5
    for want, got in zip(reference, candidate, strict=True):
        assert set(want.keys(True, True)) == set(got.keys(True, True))
        for key in want.keys(True, True):
            assert torch.equal(want[key], got[key]), key
    assert np.isfinite(reference[-1]["next", "reward"].numpy()).all()
