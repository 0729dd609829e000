"""``ClusterEnv(learner_envs=k)``: the learner steps envs ``0..k-1`` itself, exactly as ``SyncVectorEnv`` would.

Everything a user does with the envs reaches those too (resets with seeds, options and masks,
attribute calls); what needs every env in a worker (first-ready batches, a ``PolicyRunner``)
is refused with a clear error.
"""

from __future__ import annotations

import functools
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import clusterenv
from clusterenv import ClusterEnv, PolicyRunner
from tests.conftest import assert_same, kill_mid_step
from tests.envs import FailingEnv, SparseInfoRichEnv
from tests.test_equivalence import MODES, run_lockstep

CARTPOLE = functools.partial(gym.make, "CartPole-v1")
LAYOUTS = {
    "1 worker, shared memory": {"num_workers": 1},
    "2 workers, messages": {"num_workers": 2, "shared_memory": False},
    "1 worker, 2 env processes": {"num_workers": 1, "procs_per_worker": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_the_learners_own_envs_step_bit_identically_to_sync_vector_env(mode, layout):
    """Dict/Tuple observations, infos that come and go: the learner's envs and the workers' merge as Sync's."""
    env_fns = [functools.partial(SparseInfoRichEnv, "dict")] * 6
    with (
        ClusterEnv(env_fns, learner_envs=3, autoreset_mode=mode, **layout) as envs,
        closing(SyncVectorEnv(env_fns, autoreset_mode=mode)) as reference,
    ):
        assert envs.learner_info["learner_envs"] == 3
        assert [w["env_ids"] for w in envs.worker_info][0][0] == 3  # the workers' envs follow the learner's
        assert run_lockstep(reference, envs, steps=120, seed=5) >= 10


def test_resets_with_options_masks_and_seeds_reach_the_learners_envs():
    with (
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert_same(reference.reset(seed=[1, 8, 3, 4]), envs.reset(seed=[1, 8, 3, 4]))
        for t in range(5):
            assert_same(reference.step(np.array([t % 2, 1, 0, 1])), envs.step(np.array([t % 2, 1, 0, 1])))
        mask = {"reset_mask": np.array([True, False, False, True])}
        assert_same(reference.reset(seed=9, options=dict(mask)), envs.reset(seed=9, options=dict(mask)))
        only_workers = {"reset_mask": np.array([False, False, True, False])}
        assert_same(reference.reset(options=dict(only_workers)), envs.reset(options=dict(only_workers)))
        assert_same(reference.step(np.array([1, 1, 1, 1])), envs.step(np.array([1, 1, 1, 1])))


def test_attribute_calls_reach_the_learners_envs_in_env_order():
    with ClusterEnv([CARTPOLE] * 5, learner_envs=2, num_workers=2) as envs:
        envs.reset(seed=0)
        assert envs.get_attr("np_random_seed") == (0, 1, 2, 3, 4)
        assert envs.get_attr("np_random_seed", indices=[4, 0, 2, 1]) == (4, 0, 2, 1)
        envs.set_attr("tag", ["a", "b", "c", "d", "e"])
        assert envs.get_attr("tag", indices=[1, 3]) == ("b", "d")
        envs.set_attr("tag", ["x", "y"], indices=[0, 4])
        assert envs.call("get_wrapper_attr", "tag") == ("x", "b", "c", "d", "y")
        assert envs.apply(lambda env: env.spec.id, indices=[1]) == ("CartPole-v1",)


def test_an_error_in_the_learners_envs_is_raised_as_itself_and_closes_the_env():
    with ClusterEnv([functools.partial(FailingEnv, 2)] * 3, learner_envs=1, num_workers=1) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(3, dtype=np.int64))
        with pytest.raises(ValueError, match="deliberate failure at step 2"):
            envs.step(np.zeros(3, dtype=np.int64))
        assert envs.closed


def test_under_on_env_error_reset_an_error_of_theirs_ends_only_its_episode_as_in_a_worker():
    fns = [functools.partial(FailingEnv, 3)] * 2
    runs = []
    for learner_envs in (0, 1):
        with ClusterEnv(fns, learner_envs=learner_envs, num_workers=1, on_env_error="reset") as envs:
            envs.reset(seed=0)
            steps = [envs.step(np.zeros(2, dtype=np.int64)) for _ in range(4)]
            runs.append([(s[3].tolist(), sorted(k for k in s[4] if not k.startswith("_"))) for s in steps])
    assert runs[0] == runs[1]
    assert runs[0][2][0] == [True, True]  # each env's third step raised: its episode ended truncated


def test_a_lost_worker_is_replaced_while_the_learners_envs_go_on_exactly():
    with (
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1, on_worker_failure="restart") as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert_same(reference.reset(seed=7)[0], envs.reset(seed=7)[0])
        kill_mid_step(envs, np.array([0, 1, 0, 1]), [0])
        obs, rewards, terminations, truncations, infos = envs.step_wait()
        expected = reference.step(np.array([0, 1, 0, 1]))
        assert_same(obs[:2], expected[0][:2]) and assert_same(rewards[:2], expected[1][:2])
        assert infos["worker_restarted"].tolist() == [False, False, True, True]


def test_make_vec_passes_learner_envs_through():
    with clusterenv.make_vec("CartPole-v1", num_envs=4, vector_kwargs={"learner_envs": 2, "num_workers": 1}) as envs:
        assert envs.learner_envs == 2 and envs.num_workers == 1
        assert "learner_envs=2" in repr(envs)


def test_what_needs_every_env_in_a_worker_is_refused_clearly():
    with ClusterEnv([CARTPOLE] * 4, learner_envs=2, num_workers=1) as envs:
        with pytest.raises(ValueError, match="use `learner_envs=0` for first-ready batches"):
            envs.async_reset(seed=0)
        envs.reset(seed=0)
        with pytest.raises(ValueError, match=r"cannot reach the 2 envs the learner steps itself \(`learner_envs`\)"):
            PolicyRunner(envs, torch_policy(), clusterenv.Never())


@pytest.mark.parametrize(
    "value, error, match",
    [
        (
            4,
            ValueError,
            "`learner_envs` must be between 0 and num_envs - 1 (3): the workers step at least one env, got 4.",
        ),
        (-1, ValueError, "got -1"),
        (1.5, TypeError, "`learner_envs` must be an integer, got float (1.5)."),
    ],
)
def test_bad_learner_envs_are_refused(value, error, match):
    with pytest.raises(error, match=re_escape(match)):
        ClusterEnv([CARTPOLE] * 4, learner_envs=value)


def test_batch_size_needs_learner_envs_zero():
    with pytest.raises(ValueError, match="need `learner_envs=0`"):
        ClusterEnv([CARTPOLE] * 4, learner_envs=2, batch_size=2)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def torch_policy():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(4, 2))


def test_the_learner_steps_single_envs_only():
    """A unit (a vector env) among the learner's entries is refused, naming the entry."""
    unit = functools.partial(gym.vector.SyncVectorEnv, [CARTPOLE] * 2)
    with pytest.raises(ValueError, match=r"entries \[1\] of `env_fns` make vector envs"):
        ClusterEnv([CARTPOLE, unit, CARTPOLE], learner_envs=2, num_workers=1)


def test_units_after_the_learners_envs_step_exactly():
    unit = functools.partial(gym.vector.SyncVectorEnv, [CARTPOLE] * 2)
    with (
        ClusterEnv([CARTPOLE, CARTPOLE, unit], learner_envs=2, num_workers=1) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 4)) as reference,
    ):
        assert envs.num_envs == 4 and envs.worker_info[0]["units"] == [(2, 3)]
        assert run_lockstep(reference, envs, steps=100, seed=2) >= 3
