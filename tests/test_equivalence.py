"""ClusterEnv returns exactly what SyncVectorEnv returns, for every space kind and autoreset mode."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv
from tests.conftest import assert_same
from tests.envs import RichSpacesEnv, TextObsEnv, TypedInfoEnv

STEPS = 300  # every case crosses at least 10 episode ends (asserted below)

ENVS = {
    "CartPole-v1": functools.partial(gym.make, "CartPole-v1"),
    "Acrobot-v1": functools.partial(gym.make, "Acrobot-v1", max_episode_steps=100),
    "Pendulum-v1(Box action)": functools.partial(gym.make, "Pendulum-v1", max_episode_steps=30),
    "FrozenLake-v1(Discrete obs)": functools.partial(gym.make, "FrozenLake-v1"),
    "Taxi-v4(action_mask infos)": functools.partial(gym.make, "Taxi-v4", max_episode_steps=40),
    "Blackjack-v1(Tuple obs)": functools.partial(gym.make, "Blackjack-v1"),
    "Rich(Dict obs, Discrete action)": functools.partial(RichSpacesEnv, "discrete"),
    "Rich(Box action)": functools.partial(RichSpacesEnv, "box"),
    "Rich(MultiDiscrete action)": functools.partial(RichSpacesEnv, "multidiscrete"),
    "Rich(MultiBinary action)": functools.partial(RichSpacesEnv, "multibinary"),
    "Rich(Tuple action)": functools.partial(RichSpacesEnv, "tuple"),
    "Rich(Dict action)": functools.partial(RichSpacesEnv, "dict"),
    "Text obs(pickled path)": TextObsEnv,
}

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


def run_lockstep(reference, candidate, steps: int, seed: int) -> int:
    """Drive both vector envs with the same actions; return how many episodes ended."""
    assert_same(reference.reset(seed=seed), candidate.reset(seed=seed))
    reference.action_space.seed(seed)
    episodes = 0
    for _ in range(steps):
        actions = reference.action_space.sample()
        expected = reference.step(actions)
        assert_same(expected, candidate.step(actions))
        done = expected[2] | expected[3]
        episodes += int(done.sum())
        if reference.metadata["autoreset_mode"] == AutoresetMode.DISABLED and done.any():
            options = {"reset_mask": done}
            assert_same(reference.reset(options=dict(options)), candidate.reset(options=dict(options)))
    return episodes


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("env_fn", ENVS.values(), ids=ENVS.keys())
def test_bit_identical_to_sync_vector_env(env_fn, mode):
    num_envs = 5  # split 2 + 3 over two workers: slices must not line up with anything
    reference = SyncVectorEnv([env_fn] * num_envs, autoreset_mode=mode)
    with ClusterEnv([env_fn] * num_envs, num_workers=2, autoreset_mode=mode) as candidate:
        assert candidate.single_observation_space == reference.single_observation_space
        assert candidate.single_action_space == reference.single_action_space
        assert candidate.observation_space == reference.observation_space
        assert candidate.action_space == reference.action_space
        episodes = run_lockstep(reference, candidate, STEPS, seed=123)
    reference.close()
    assert episodes >= 10, "the run must cross episode boundaries to test autoreset"


# procs_per_worker > 1: each worker splits its slice again over env processes. The kinds that
# stress what crosses the extra hop: Dict obs and infos with keys that come and go, Tuple
# actions, action-mask infos, and observations without an array form.
PROCS_ENVS = {
    name: ENVS[name]
    for name in (
        "Taxi-v4(action_mask infos)",
        "Rich(Dict obs, Discrete action)",
        "Rich(Tuple action)",
        "Text obs(pickled path)",
    )
}


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("env_fn", PROCS_ENVS.values(), ids=PROCS_ENVS.keys())
def test_env_processes_are_bit_identical_to_sync_vector_env(env_fn, mode):
    # (Other process counts, one to seven, are covered by test_worker_and_process_counts_do_not_change_results.)
    num_envs, procs = 7, 3  # 3 + 4 over two workers, then 1 + 1 + 1 and 1 + 2 + 1 over env processes
    reference = SyncVectorEnv([env_fn] * num_envs, autoreset_mode=mode)
    with ClusterEnv([env_fn] * num_envs, num_workers=2, procs_per_worker=procs, autoreset_mode=mode) as candidate:
        assert candidate.observation_space == reference.observation_space
        assert candidate.action_space == reference.action_space
        episodes = run_lockstep(reference, candidate, 300, seed=321)
    reference.close()
    assert episodes >= 5, "the run must cross episode boundaries to test autoreset"


@pytest.mark.parametrize(("num_workers", "procs"), [(1, 1), (3, 1), (7, 1), (1, 7), (1, 3), (3, 2)])
def test_worker_and_process_counts_do_not_change_results(num_workers, procs):
    env_fn = functools.partial(RichSpacesEnv, "discrete")
    reference = SyncVectorEnv([env_fn] * 7, autoreset_mode=AutoresetMode.SAME_STEP)
    with ClusterEnv(
        [env_fn] * 7, num_workers=num_workers, procs_per_worker=procs, autoreset_mode=AutoresetMode.SAME_STEP
    ) as candidate:
        run_lockstep(reference, candidate, 200, seed=7)


@pytest.mark.parametrize("procs", [1, 2], ids=lambda p: f"procs_per_worker={p}")
def test_seed_list_with_none_and_options_reach_every_env(procs):
    env_fn = functools.partial(RichSpacesEnv, "discrete")
    reference = SyncVectorEnv([env_fn] * 3)
    with ClusterEnv([env_fn] * 3, num_workers=2, procs_per_worker=procs) as candidate:
        seeds = [5, None, 9]
        expected = reference.reset(seed=seeds, options={"level": 2})
        got = candidate.reset(seed=seeds, options={"level": 2})
        np.testing.assert_array_equal(expected[0]["image"][[0, 2]], got[0]["image"][[0, 2]])
        assert_same(got[1]["options"], expected[1]["options"])


def test_copy_false_reuses_one_buffer_and_copy_true_does_not():
    env_fn = functools.partial(gym.make, "CartPole-v1")
    with ClusterEnv([env_fn] * 2, num_workers=2, copy=False) as envs:
        first, _ = envs.reset(seed=0)
        second = envs.step(np.zeros(2, dtype=np.int64))[0]
        assert first is second
    with ClusterEnv([env_fn] * 2, num_workers=2) as envs:
        first, _ = envs.reset(seed=0)
        kept = first.copy()
        envs.step(np.zeros(2, dtype=np.int64))
        np.testing.assert_array_equal(first, kept)


# 8 envs, 4 per worker: enough for each worker to pack its slice's infos (see clusterenv.wire.infos).
INFO_TYPES = {
    "slices agree": [int] * 8,
    "slices disagree": [int] * 4 + [float] * 4,  # both pack; the second does not fit the first
    "a slice mixes types": [float, int, np.float32, int] + [float] * 4,  # the first travels as records
}


@pytest.mark.parametrize("types", INFO_TYPES.values(), ids=INFO_TYPES.keys())
def test_infos_whose_types_differ_between_envs_batch_as_in_sync_vector_env(types):
    env_fns = [functools.partial(TypedInfoEnv, value_type) for value_type in types]
    reference = SyncVectorEnv(env_fns)
    with ClusterEnv(env_fns, num_workers=2) as candidate:
        run_lockstep(reference, candidate, steps=40, seed=5)
    reference.close()
