"""Rollouts by local policies: documented shapes, and the same transitions as step mode."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import Categorical, ClusterEnv, EpsilonGreedy, Greedy, Never, PolicyRunner, RolloutBatch
from tests.conftest import assert_same
from tests.envs import BoxInfoEnv
from tests.policies import linear_policy, outputs


def step_mode_reference(reference, policy, head, rngs, steps, obs):
    """What a learner choosing the actions itself would record, with the documented sampling scheme."""
    previous_done = np.zeros(reference.num_envs, dtype=np.bool_)
    record = {k: [] for k in ("obs", "actions", "logprobs", "logits", "rewards", "terminations", "truncations")}
    record["autoreset"], record["infos"] = [], []
    for _ in range(steps):
        logits = outputs(policy, obs)
        actions, logprobs = head.act(logits, rngs)
        record["obs"].append(obs)
        record["actions"].append(actions)
        record["logprobs"].append(logprobs)
        record["logits"].append(logits)
        record["autoreset"].append(
            previous_done if reference.autoreset_mode == AutoresetMode.NEXT_STEP else np.zeros_like(previous_done)
        )
        obs, rewards, terminations, truncations, infos = reference.step(actions)
        record["rewards"].append(rewards)
        record["terminations"].append(terminations)
        record["truncations"].append(truncations)
        record["infos"].append(infos)
        previous_done = terminations | truncations
    return record, obs


def check_documented_fields(batch, steps, num_envs, obs_shape, num_actions):
    expected = {
        "obs": ((steps, num_envs, *obs_shape), np.float32),
        "actions": ((steps, num_envs), np.int64),
        "logprobs": ((steps, num_envs), np.float32),
        "logits": ((steps, num_envs, num_actions), np.float32),
        "rewards": ((steps, num_envs), np.float64),
        "terminations": ((steps, num_envs), np.bool_),
        "truncations": ((steps, num_envs), np.bool_),
        "autoreset": ((steps, num_envs), np.bool_),
        "policy_versions": ((steps, num_envs), np.int64),
        "next_obs": ((num_envs, *obs_shape), np.float32),
    }
    for name, (shape, dtype) in expected.items():
        value = getattr(batch, name)
        assert isinstance(value, np.ndarray) and value.flags.writeable, name
        assert (value.shape, value.dtype) == (shape, np.dtype(dtype)), name
    assert (batch.num_steps, batch.num_envs, len(batch.infos)) == (steps, num_envs, steps)
    tensors = batch.as_tensors()
    assert set(tensors) == set(expected)
    assert tensors["obs"].dtype == torch.float32 and tensors["autoreset"].dtype == torch.bool


CASES = [
    (AutoresetMode.NEXT_STEP, Greedy(), 2, 1),
    (AutoresetMode.SAME_STEP, Categorical(), 2, 1),
    (AutoresetMode.NEXT_STEP, Categorical(temperature=0.5), 1, 1),
    (AutoresetMode.NEXT_STEP, Categorical(), 2, 2),  # env processes: the policy acts in the worker
    (AutoresetMode.SAME_STEP, Greedy(), 1, 3),
]


@pytest.mark.parametrize(
    "mode, head, num_workers, procs",
    CASES,
    ids=[f"{m.value}-{type(h).__name__}-{w}workers-{p}procs" for m, h, w, p in CASES],
)
def test_rollout_equals_step_mode_for_the_same_seeds(mode, head, num_workers, procs):
    policy, num_envs, steps, seed = linear_policy(3, 3, seed=4), 5, 25, 11
    reference = SyncVectorEnv([BoxInfoEnv] * num_envs, autoreset_mode=mode)
    with ClusterEnv(
        [BoxInfoEnv] * num_envs, num_workers=num_workers, procs_per_worker=procs, autoreset_mode=mode
    ) as envs:
        expected_obs, expected_infos = reference.reset(seed=3)
        obs, infos = envs.reset(seed=3)
        assert_same((expected_obs, expected_infos), (obs, infos))
        runner = PolicyRunner(envs, policy, Never(), head=head, seed=seed)
        batch = runner.rollout(steps)
        check_documented_fields(batch, steps, num_envs, (3,), 3)
        assert (batch.policy_versions == 0).all() and batch.learner_version == 0
        probs = torch.softmax(torch.as_tensor(batch.logits) / getattr(head, "temperature", 1.0), -1).numpy()
        chosen = np.take_along_axis(probs, batch.actions[..., None], -1)[..., 0]
        np.testing.assert_allclose(np.exp(batch.logprobs), chosen, rtol=1e-5)

        rngs = [np.random.default_rng([seed, i]) for i in range(num_envs)]  # the documented sampling streams
        record, next_obs = step_mode_reference(reference, policy, head, rngs, steps, expected_obs)
        for name in ("obs", "actions", "rewards", "terminations", "truncations", "autoreset"):
            np.testing.assert_array_equal(getattr(batch, name), np.stack(record[name]), err_msg=name)
        for name in ("logits", "logprobs"):
            np.testing.assert_allclose(getattr(batch, name), np.stack(record[name]), rtol=1e-5, atol=1e-6)
        assert_same(batch.infos, record["infos"])
        np.testing.assert_array_equal(batch.next_obs, next_obs)
        assert batch.terminations.any() and batch.truncations.any(), "the run must cross both kinds of episode end"

        # Step mode keeps working on the same envs, and a later rollout continues from there.
        actions = np.array([0, 1, 2, 1, 0])
        assert_same(reference.step(actions), envs.step(actions))
        second = runner.rollout(4)
        later, _ = step_mode_reference(reference, policy, head, rngs, 4, second.obs[0])
        np.testing.assert_array_equal(second.actions, np.stack(later["actions"]))
        np.testing.assert_array_equal(second.rewards, np.stack(later["rewards"]))
    reference.close()


def box_env_with_statistics():
    return gym.wrappers.RecordEpisodeStatistics(BoxInfoEnv(max_len=5))


@pytest.fixture(scope="module")
def box_envs():
    with ClusterEnv([box_env_with_statistics] * 4, num_workers=2) as envs:
        yield envs


def test_epsilon_greedy_acts_on_q_values_for_dqn(box_envs):
    q_net = linear_policy(3, 3, seed=2)
    runner = PolicyRunner(box_envs, q_net, Never(), head=EpsilonGreedy(0.0), seed=0)
    greedy = runner.rollout(20)
    np.testing.assert_array_equal(greedy.actions, outputs(q_net, greedy.obs).argmax(-1))
    np.testing.assert_array_equal(greedy.logprobs, 0.0)
    uniform = runner.rollout(200, head=EpsilonGreedy(1.0))
    np.testing.assert_allclose(uniform.logprobs, math.log(1 / 3), rtol=1e-6)
    counts = np.bincount(uniform.actions.ravel(), minlength=3)
    assert counts.min() > 200, f"uniform over 3 actions in 800 draws, got {counts}"


def test_episode_statistics_reach_the_batch_infos(box_envs):
    box_envs.reset(seed=0)
    runner = PolicyRunner(box_envs, linear_policy(3, 3, seed=0), seed=0)
    batch = runner.rollout(24)
    episodes = batch.episodes()
    assert len(episodes) >= 6
    for t, env, ret, length in episodes:
        assert batch.terminations[t, env] or batch.truncations[t, env]
        start = t - length + 1
        assert not batch.autoreset[start : t + 1, env].any(), "episode steps exclude reset steps"
        assert ret == pytest.approx(batch.rewards[start : t + 1, env].sum())
    assert isinstance(batch, RolloutBatch)
