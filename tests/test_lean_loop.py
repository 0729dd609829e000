"""The lean loop (clusterenv.stepping.lean_loop) steps envs exactly as SyncVectorEnv.step does.

Workers and the learner's own envs step their slices with it under NEXT_STEP and SAME_STEP;
here one RecordingVectorEnv is held against one SyncVectorEnv, the infos it records replayed
as a worker's are (Gymnasium's own _add_info), step for step.
"""

from __future__ import annotations

import functools

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv.stepping.failures import EnvTracker
from clusterenv.stepping.lean_loop import takes_lean_step
from clusterenv.stepping.recording_env import build
from tests.conftest import assert_same
from tests.envs import BoxInfoEnv, FailingEnv

CARTPOLE = functools.partial(gym.make, "CartPole-v1")


class Float64ObsEnv(BoxInfoEnv):
    """Observations of float64 for a float32 Box: Gymnasium's concatenate casts them (same kind)."""

    def step(self, action):
        obs, *rest = super().step(action)
        return obs.astype(np.float64), *rest


def recording(env_fn, n, mode, samples_steps=False):
    vector = build([cloudpickle.dumps(env_fn)] * n, "same", mode, EnvTracker())
    vector.samples_steps = samples_steps
    return vector


def replayed(sync: SyncVectorEnv, infos_log):
    """The records batched by Gymnasium's own ``_add_info`` (of a plain ``SyncVectorEnv`` of as many envs)."""
    infos: dict = {}
    for index, info in infos_log:
        infos = sync._add_info(infos, info, index)
    return infos


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=["NextStep", "SameStep"])
@pytest.mark.parametrize("env_fn", [CARTPOLE, BoxInfoEnv, Float64ObsEnv], ids=["CartPole", "infos", "float64 obs"])
@pytest.mark.parametrize("sampled", [False, True], ids=["untimed", "timed"])
def test_the_lean_loop_returns_what_sync_vector_env_returns(mode, env_fn, sampled):
    n = 5
    lean, reference = recording(env_fn, n, mode, sampled), SyncVectorEnv([env_fn] * n, autoreset_mode=mode)
    lean.reset(seed=7)
    reference.reset(seed=7)
    rng = np.random.default_rng(0)
    for _ in range(120):
        actions = rng.integers(0, reference.single_action_space.n, size=n)
        assert takes_lean_step(lean, actions)
        lean.info_log = []
        *got, _ = lean.step(actions)
        *expected, expected_infos = reference.step(actions)
        assert_same(tuple(got), tuple(expected))
        assert_same(replayed(reference, lean.info_log), expected_infos)
    lean.close()
    reference.close()


def test_step_into_writes_the_rows_it_is_given():
    lean, reference = recording(CARTPOLE, 3, AutoresetMode.NEXT_STEP), SyncVectorEnv([CARTPOLE] * 3)
    lean.reset(seed=1)
    reference.reset(seed=1)
    rows = np.zeros(3), np.zeros(3, bool), np.zeros(3, bool)
    for t in range(40):
        actions = np.full(3, t % 2)
        obs = lean.step_into(actions, *rows)
        expected = reference.step(actions)
        assert_same(obs, expected[0])
        for row, value in zip(rows, expected[1:4], strict=True):
            assert_same(row, value)


def test_other_actions_take_sync_vector_envs_own_loop():
    lean = recording(CARTPOLE, 2, AutoresetMode.NEXT_STEP)
    assert not takes_lean_step(lean, [0, 1])  # a list: Gymnasium's iterate decides
    assert not takes_lean_step(lean, np.zeros(3, np.int64))  # the wrong length: zip(strict=True) raises there
    disabled = recording(CARTPOLE, 2, AutoresetMode.DISABLED)
    assert not takes_lean_step(disabled, np.zeros(2, np.int64))


def test_an_env_that_raises_is_named_by_its_index():
    fns = [functools.partial(FailingEnv, fail_at=10**6)] * 3 + [functools.partial(FailingEnv, fail_at=2)]
    vector = build([cloudpickle.dumps(fn) for fn in fns], "same", AutoresetMode.NEXT_STEP, EnvTracker())
    vector.samples_steps = False
    vector.reset(seed=0)
    vector.step(np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="deliberate failure at step 2"):
        vector.step(np.zeros(4, np.int64))
    assert vector.envs.tracker.reached == 3
