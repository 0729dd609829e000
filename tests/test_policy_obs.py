"""Local policies on every array observation space: Dict and Tuple (nested) reach the module as dicts and tuples."""

from __future__ import annotations

import copy
import functools
import logging
import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import SyncVectorEnv

from clusterenv import APS, Categorical, ClusterEnv, Greedy, PolicyError, PolicyRunner, ProtocolError
from clusterenv.policy.strategies import mean_kl
from clusterenv.wire.protocol import ROLLOUT_FIELDS, rollout_frames, split_rollout_frames
from tests.conftest import assert_same
from tests.envs import RichSpacesEnv, TextObsEnv
from tests.policies import DictPolicy, TuplePolicy, structured_outputs

BIG_IMAGE = (96, 96, 4)  # 36 KiB per env: two envs per worker go through shared memory
FIELDS = ("actions", "logprobs", "logits", "rewards", "terminations", "truncations", "autoreset", "policy_versions")


def rich_envs(num_envs: int, workers: int, image_shape=(6, 5, 3), **kwargs) -> ClusterEnv:
    env_fn = functools.partial(RichSpacesEnv, image_shape=image_shape)
    return ClusterEnv([env_fn] * num_envs, num_workers=workers, **kwargs)


def blackjacks(num_envs: int, workers: int, **kwargs) -> ClusterEnv:
    return ClusterEnv([functools.partial(gym.make, "Blackjack-v1")] * num_envs, num_workers=workers, **kwargs)


def leaves(tree):
    """The leaves of a dict/tuple tree of arrays, depth first."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    if isinstance(tree, tuple):
        return [leaf for value in tree for leaf in leaves(value)]
    return [tree]


def tree_map(fn, tree):
    if isinstance(tree, dict):
        return {key: tree_map(fn, value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, value) for value in tree)
    return fn(tree)


def concat(trees):
    """Successive observation trees as one, along the time axis."""
    first = trees[0]
    if isinstance(first, dict):
        return {key: concat([t[key] for t in trees]) for key in first}
    if isinstance(first, tuple):
        return tuple(concat([t[i] for t in trees]) for i in range(len(first)))
    return np.concatenate(trees)


def check_against_sync_vector_env(batches, env_fn, num_envs, policy, seed):
    """Successive batches are what one SyncVectorEnv gives for the same seeds and the policy's greedy actions."""
    observed = concat([b.obs for b in batches])
    actions, rewards, terminations, truncations = (
        np.concatenate([getattr(b, name) for b in batches])
        for name in ("actions", "rewards", "terminations", "truncations")
    )
    reference = SyncVectorEnv([env_fn] * num_envs)
    obs, _ = reference.reset(seed=seed)
    for t in range(len(actions)):
        assert_same(tree_map(lambda leaf, t=t: leaf[t], observed), obs)
        greedy = structured_outputs(policy, obs).argmax(-1)
        np.testing.assert_array_equal(actions[t], greedy, err_msg=f"step {t}")
        obs, *step = reference.step(greedy)
        for name, got, expected in zip(
            ("rewards", "terminations", "truncations"), (rewards, terminations, truncations), step, strict=False
        ):
            np.testing.assert_array_equal(got[t], expected, err_msg=f"{name} at step {t}")
    assert_same(batches[-1].next_obs, obs)
    reference.close()


# -- Dict observations ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("workers", "procs", "image_shape"),
    [(2, 1, (6, 5, 3)), (1, 2, (6, 5, 3)), (2, 1, BIG_IMAGE)],
    ids=["2workers", "procs=2", "shared-memory-image"],
)
def test_dict_observations_reach_the_module_and_the_batch_as_step_mode_returns_them(
    workers, procs, image_shape, caplog
):
    policy = DictPolicy(3, image_shape, seed=1)
    caplog.set_level(logging.DEBUG, logger="clusterenv.learner.step_buffers")
    with rich_envs(4, workers, image_shape, procs_per_worker=procs) as envs:
        batch = PolicyRunner(envs, policy, head=Greedy(), seed=5).rollout(40)
    if image_shape == BIG_IMAGE:  # the workers' envs write into the learner's mapping; rollouts still copy per leaf
        assert "Workers [0, 1] write observations into shared memory" in caplog.text
    assert batch.truncations.any() and batch.terminations.any(), "the run must cross episode ends"
    check_against_sync_vector_env([batch], functools.partial(RichSpacesEnv, image_shape=image_shape), 4, policy, 5)


def test_dict_observations_keep_their_structure_and_dtypes():
    space = RichSpacesEnv().observation_space
    with rich_envs(3, 2) as envs:
        batch = PolicyRunner(envs, DictPolicy(3), seed=0).rollout(6)
    assert list(batch.obs) == list(space.spaces) and isinstance(batch.obs["state"], tuple)
    specs = [(np.dtype(s.dtype), s.shape) for s in (space["flags"], space["grid"], space["image"], *space["state"])]
    for got, (dtype, shape) in zip(leaves(batch.obs), specs, strict=True):
        assert (got.dtype, got.shape) == (dtype, (6, 3, *shape)) and got.flags.writeable
    for got, (dtype, shape) in zip(leaves(batch.next_obs), specs, strict=True):
        assert (got.dtype, got.shape) == (dtype, (3, *shape))
    assert batch.obs["image"].dtype == np.uint8, "images travel and stay as uint8"
    tensors = batch.as_tensors()
    assert tensors["obs"]["image"].dtype == torch.uint8 and tensors["obs"]["state"][0].dtype == torch.float64
    assert tensors["next_obs"]["state"][1].shape == (3,) and tensors["actions"].shape == (6, 3)
    assert (batch.num_steps, batch.num_envs, len(batch.infos)) == (6, 3, 6)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetched_dict_batches_are_one_long_rollout(prefetch):
    policy = DictPolicy(3, seed=2)
    with rich_envs(4, 2) as envs:
        runner = PolicyRunner(envs, policy, head=Greedy(), seed=9, prefetch=prefetch)
        batches = [runner.rollout(10) for _ in range(3)]
        leftovers = runner.stop()
    assert len(leftovers) == prefetch
    with rich_envs(4, 2) as envs:  # the same split: logits are float sums over each worker's batch
        long = PolicyRunner(envs, policy, head=Greedy(), seed=9).rollout(30)
    assert_same(concat([b.obs for b in batches]), long.obs)
    assert_same(batches[-1].next_obs, long.next_obs)
    for name in FIELDS[:-1]:
        np.testing.assert_array_equal(np.concatenate([getattr(b, name) for b in batches]), getattr(long, name), name)
    assert_same(tree_map(lambda leaf: leaf[0], leftovers[0].obs), batches[-1].next_obs)


def test_dict_fragments_continue_each_other():
    policy = DictPolicy(3, seed=4)
    with rich_envs(5, 2) as envs:
        runner = PolicyRunner(envs, policy, head=Greedy(), seed=3, prefetch=1)
        per_worker: dict[tuple[int, ...], list] = {}
        stream = runner.fragments(6)
        for _ in range(4):
            fragment = next(stream)
            per_worker.setdefault(tuple(fragment.env_ids.tolist()), []).append(fragment)
        stream.close()
        for fragment in runner.stop():
            per_worker.setdefault(tuple(fragment.env_ids.tolist()), []).append(fragment)
    # A worker may deliver more than its share of the 4 fragments, plus what stop() returns (prefetch 1, one in
    # flight): at most 6 fragments of 6 steps; each worker's must be the start of its own long trajectory.
    with rich_envs(5, 2) as envs:
        long = PolicyRunner(envs, policy, head=Greedy(), seed=3).rollout(6 * 6)
    assert len(per_worker) == 2
    for env_ids, fragments in per_worker.items():
        got = concat([f.obs for f in fragments])
        steps = len(leaves(got)[0])
        assert_same(got, tree_map(lambda leaf, steps=steps, ids=list(env_ids): leaf[:steps, ids], long.obs))
        np.testing.assert_array_equal(
            np.concatenate([f.actions for f in fragments]), long.actions[:steps, list(env_ids)]
        )


# -- APS on structured probe states --------------------------------------------------------
def test_aps_measures_the_kl_on_the_same_dict_states_on_both_sides():
    probe_steps, steps = 3, 5
    policy = DictPolicy(3, seed=0)
    acting = copy.deepcopy(policy)
    with rich_envs(4, 2) as envs:
        runner = PolicyRunner(envs, policy, APS(threshold=1e-9), seed=0, probe_steps=probe_steps)
        first = runner.rollout(steps)
        with torch.no_grad():
            policy.image.weight.mul_(-3.0)
            policy.box.bias.add_(torch.tensor([1.0, 0.0, -1.0]))
        runner.publish()
        second = runner.rollout(steps)
        telemetry = runner.telemetry
        slices = envs.worker_slices
    for w, sl in enumerate(slices):
        # Each worker's last probe_steps observations, (step, env) row-major, as both ends flatten them.
        states = tree_map(lambda leaf, sl=sl: leaf[-probe_steps:, sl].reshape(-1, *leaf.shape[2:]), first.obs)
        local = first.logits[-probe_steps:, sl].reshape(-1, 3)
        np.testing.assert_allclose(local, structured_outputs(acting, states), rtol=1e-5, atol=1e-6)
        expected = mean_kl(Categorical(), structured_outputs(policy, states), local)
        assert expected > 1e-3
        assert telemetry.workers[w].last_kl == pytest.approx(expected, rel=1e-4)
        assert telemetry.workers[w].pulls == 1
    assert (second.policy_versions == 1).all()
    assert telemetry.total.mean_kl is not None


def test_prefetching_aps_measures_kl_and_pulls_on_dict_observations():
    policy = DictPolicy(3, seed=0)
    with rich_envs(4, 2) as envs:
        runner = PolicyRunner(envs, policy, APS(threshold=1e-6), seed=0, prefetch=1, probe_steps=4)
        for _ in range(5):
            batch = runner.rollout(6)
            with torch.no_grad():
                policy.image.weight.mul_(-2.0)
            runner.publish()
        runner.stop()
        telemetry = runner.telemetry
    assert telemetry.total.mean_kl is not None and telemetry.total.mean_kl > 0
    assert all(worker.pulls >= 1 for worker in telemetry.workers)
    assert batch.policy_versions.max() >= 1


# -- Tuple observations --------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1], ids=["lockstep", "prefetch=1"])
def test_tuple_observations_of_blackjack(prefetch):
    policy = TuplePolicy(seed=3)
    with blackjacks(4, 2) as envs:
        runner = PolicyRunner(envs, policy, head=Greedy(), seed=1, prefetch=prefetch, sync=APS(threshold=1e-6))
        batches = [runner.rollout(8) for _ in range(2)]
        runner.stop()
        assert runner.telemetry.total.kl_checks > 0
    assert isinstance(batches[0].obs, tuple) and len(batches[0].obs) == 3
    assert all(leaf.dtype == np.int64 and leaf.shape == (8, 4) for leaf in batches[0].obs)
    assert batches[0].terminations.any()
    check_against_sync_vector_env(batches, functools.partial(gym.make, "Blackjack-v1"), 4, policy, 1)
    tensors = batches[0].as_tensors()
    assert isinstance(tensors["obs"], tuple) and tensors["obs"][0].dtype == torch.int64


# -- refusals, before anything reaches the workers ------------------------------------------
def test_a_module_that_cannot_take_a_dict_is_refused_with_the_structure_it_would_get():
    with rich_envs(2, 1) as envs:
        with pytest.raises(PolicyError) as info:
            PolicyRunner(envs, torch.nn.Linear(4, 3))
        message = str(info.value)
        assert message.startswith("The policy raised TypeError on a batch of observations of space Dict(")
        assert re.search(
            r"passed as a dict of tensors \{'flags': \(2, 4\) int8, .*'image': \(2, 6, 5, 3\) uint8", message
        )
        assert "'state': ((2, 3) float32, (2,) int64)" in message
        assert "FlattenObservation" in message and "linear(): argument 'input'" in message
        # Nothing was shipped: the envs still step.
        envs.reset(seed=0)
        assert envs.step(np.zeros(2, dtype=np.int64))[1].shape == (2,)


def test_a_module_that_cannot_take_a_tuple_is_refused():
    with blackjacks(2, 1) as envs:
        with pytest.raises(
            PolicyError, match=re.escape("passed as a tuple of tensors ((2,) int64, (2,) int64, (2,) int64)")
        ):
            PolicyRunner(envs, torch.nn.Linear(3, 2))


def test_observations_without_an_array_form_are_refused():
    with ClusterEnv([TextObsEnv], num_workers=1) as envs:
        with pytest.raises(PolicyError, match=re.escape("Local policies take observations of array spaces")) as info:
            PolicyRunner(envs, torch.nn.Linear(1, 2))
        assert "Text(" in str(info.value)


def test_rollout_frames_carry_one_frame_per_observation_leaf():
    obs, next_obs = [np.zeros((2, 3, 4)), np.ones((2, 3), np.uint8)], [np.zeros((3, 4)), np.ones(3, np.uint8)]
    fields = {name: np.full((2, 3), i) for i, name in enumerate(ROLLOUT_FIELDS[1:])}
    frames = rollout_frames(obs, fields, next_obs)
    assert len(frames) == 2 + len(fields) + 2
    got_obs, got_fields, got_next = split_rollout_frames(frames, 2)
    assert_same((got_obs, got_fields, got_next), (obs, fields, next_obs))
    with pytest.raises(ProtocolError, match=re.escape("must have 12 arrays for 2 observation leaves, got 11")):
        split_rollout_frames(frames[:-1], 2)
