"""Prefetched rollouts: workers keep collecting while the learner trains, and nothing is lost or reordered."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, EveryUpdate, FixedInterval, Greedy, Never, PolicyError, PolicyRunner, WorkerLostError
from tests.conftest import wait_until
from tests.envs import SlowCartPole
from tests.policies import linear_policy, outputs

FIELDS = ("obs", "actions", "logprobs", "logits", "rewards", "terminations", "truncations", "autoreset")


def cartpoles(n: int, workers: int, **kwargs) -> ClusterEnv:
    return ClusterEnv([lambda: gym.make("CartPole-v1")] * n, num_workers=workers, **kwargs)


def concat(batches, name):
    return np.concatenate([getattr(b, name) for b in batches])


@pytest.mark.parametrize(("prefetch", "procs"), [(1, 1), (3, 1), (1, 2)], ids=["prefetch=1", "prefetch=3", "procs=2"])
def test_successive_prefetched_batches_are_one_long_rollout(prefetch, procs):
    """The same envs, seeds and deterministic policy: 4 x 16 prefetched steps == 64 lockstep steps == SyncVectorEnv."""
    policy = linear_policy(4, 2, seed=3)
    with cartpoles(6, 3, procs_per_worker=procs) as envs:
        runner = PolicyRunner(envs, policy, head=Greedy(), seed=7, prefetch=prefetch)
        batches = [runner.rollout(16) for _ in range(4)]
        leftovers = runner.stop()
    assert len(leftovers) == prefetch  # collected ahead, handed back: no step is lost
    with cartpoles(6, 2) as envs:
        long = PolicyRunner(envs, policy, head=Greedy(), seed=7).rollout(64)
    for name in FIELDS:
        np.testing.assert_array_equal(concat(batches, name), getattr(long, name), err_msg=name)
    np.testing.assert_array_equal(batches[-1].next_obs, long.next_obs)
    reference = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 6)
    obs, _ = reference.reset(seed=7)
    for t in range(64):
        np.testing.assert_array_equal(long.obs[t], obs)
        actions = outputs(policy, obs).argmax(-1)
        np.testing.assert_array_equal(long.actions[t], actions)
        obs, rewards, *_ = reference.step(actions)
        np.testing.assert_array_equal(long.rewards[t], rewards)
    reference.close()


def run_publishing(sync, rollouts: int = 5, prefetch: int = 1):
    """Publish after every batch; returns the per-step lags, the leftovers and the telemetry."""
    with cartpoles(4, 2) as envs:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=prefetch, sync=sync)
        lags = []
        for _ in range(rollouts):
            batch = runner.rollout(8)
            lags.append(batch.learner_version - batch.policy_versions)
            runner.publish()
        return lags, runner.stop(), runner.telemetry


def test_lag_is_recorded_per_step_and_in_telemetry():
    # A copy that never pulls acts with version 0 throughout: batch k is handed over after k publishes.
    lags, leftovers, telemetry = run_publishing(Never())
    for k, lag in enumerate(lags):
        assert (lag == k).all(), (k, lag)
    counts = telemetry.total.lag_counts
    assert sum(counts.values()) == (5 + len(leftovers)) * 8 * 4
    assert telemetry.total.pulls == 0


@pytest.mark.parametrize("prefetch", [1, 2])
def test_every_update_keeps_the_lag_within_the_prefetch_depth(prefetch):
    lags, _, telemetry = run_publishing(EveryUpdate(), prefetch=prefetch)
    assert (lags[0] == 0).all()  # acted with version 0, before any publish
    # publish() pushes each version to EveryUpdate workers before the rollout commands that
    # follow it, so batch k starts with at least version k - prefetch; a version pushed
    # mid-batch acts from the next step on: versions never go back.
    for k, lag in enumerate(lags):
        versions = k - lag
        assert ((0 <= lag) & (lag <= prefetch)).all(), (k, lag)
        assert (np.diff(versions, axis=0) >= 0).all(), (k, versions)
    assert all(record.pulls >= 1 for record in telemetry.workers)


def test_a_pull_asked_without_waiting_is_answered_and_versions_never_go_back():
    lags, _, telemetry = run_publishing(FixedInterval(1), prefetch=1)
    for k, lag in enumerate(lags):
        versions = k - lag
        assert (versions >= 0).all() and (np.diff(versions, axis=0) >= 0).all(), (k, versions)
    assert all(record.pulls >= 1 for record in telemetry.workers)


def test_fragments_carry_their_env_ids_and_continue_each_other():
    policy = linear_policy(4, 2, seed=1)
    with cartpoles(5, 2) as envs:
        runner = PolicyRunner(envs, policy, head=Greedy(), seed=3, prefetch=1)
        per_worker: dict[tuple[int, ...], list] = {}
        stream = runner.fragments(8)
        for _ in range(6):
            fragment = next(stream)
            per_worker.setdefault(tuple(fragment.env_ids.tolist()), []).append(fragment)
        stream.close()
        per_worker_left = runner.stop()
        for fragment in per_worker_left:
            per_worker.setdefault(tuple(fragment.env_ids.tolist()), []).append(fragment)
        slices = {tuple(range(sl.start, sl.stop)) for sl in envs.worker_slices}
    assert set(per_worker) == slices
    # A worker may deliver more than its share of the 6 fragments, plus what stop() returns (prefetch 1, one in
    # flight): at most 8 fragments of 8 steps; each worker's must be the start of its own long trajectory.
    with cartpoles(5, 1) as envs:
        long = PolicyRunner(envs, policy, head=Greedy(), seed=3).rollout(8 * 8)
    for env_ids, fragments in per_worker.items():
        for name in FIELDS:
            got = concat(fragments, name)
            np.testing.assert_array_equal(got, getattr(long, name)[: len(got), list(env_ids)], err_msg=name)


def test_at_most_prefetch_batches_are_held_when_the_learner_stops_asking():
    with cartpoles(2, 2) as envs:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=2)
        runner.rollout(4)

        def all_held():
            runner.publish()  # reads what arrived
            return runner.prefetch_backlog == [(2, 0), (2, 0)]

        assert wait_until(all_held, timeout=30), "two results held per worker, nothing in flight"
        time.sleep(0.5)  # and no more come
        runner.publish()
        assert runner.prefetch_backlog == [(2, 0), (2, 0)]
        assert len(runner.stop()) == 2
        assert runner.prefetch_backlog == [(0, 0), (0, 0)]


def test_prefetching_holds_the_envs_until_stop():
    with cartpoles(2, 1) as envs:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=1)
        runner.rollout(4)
        with pytest.raises(AlreadyPendingCallError, match="held by a prefetching PolicyRunner; call runner.stop"):
            envs.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(PolicyError, match="fixed length: it was started with num_steps=4, got 5"):
            runner.rollout(5)
        runner.stop()
        envs.step(np.zeros(2, dtype=np.int64))  # usable again
        assert runner.rollout(5).num_steps == 5


def test_close_in_the_middle_of_a_prefetch_returns_promptly():
    envs = ClusterEnv([lambda: SlowCartPole(0.02)] * 2, num_workers=2)
    runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=3)
    runner.rollout(50)  # 3 more rollouts of 1 s each are queued per worker
    started = time.monotonic()
    envs.close()
    assert time.monotonic() - started < 2.0, "workers must abandon queued rollouts on CLOSE"


def test_a_worker_killed_mid_prefetch_raises_by_default():
    envs = ClusterEnv([lambda: SlowCartPole(0.01)] * 4, num_workers=2)
    try:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=1)
        runner.rollout(10)
        os.kill(envs.worker_info[1]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="envs 2..3"):
            for _ in range(5):
                runner.rollout(10)
        assert envs.closed
    finally:
        envs.close()


def test_a_worker_killed_mid_prefetch_is_replaced_under_restart():
    envs = ClusterEnv([lambda: SlowCartPole(0.01)] * 4, num_workers=2, on_worker_failure="restart")
    try:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=1)
        runner.rollout(10)
        os.kill(envs.worker_info[1]["pid"], signal.SIGKILL)
        batches = [runner.rollout(10) for _ in range(4)]
        flagged = [b.infos[0].get("worker_restarted") for b in batches if "worker_restarted" in b.infos[0]]
        assert len(flagged) == 1 and flagged[0].tolist() == [False, False, True, True]
        assert all(b.num_envs == 4 and b.obs.shape == (10, 4, 4) for b in batches)
        runner.stop()
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("prefetch", "mode"), [(0, "LockstepRunner"), (1, "PrefetchingRunner"), (3, "PrefetchingRunner")]
)
def test_policy_runner_makes_the_runner_of_its_mode(prefetch, mode):
    with cartpoles(4, 2) as envs:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=prefetch)
        assert isinstance(runner, PolicyRunner) and type(runner).__name__ == mode
        assert runner.prefetch == prefetch
        assert runner.rollout(4).obs.shape == (4, 4, 4)
        runner.stop()


@pytest.mark.parametrize("prefetch", [-1, 1.5, True])
def test_a_prefetch_that_is_not_a_count_is_refused(prefetch):
    with cartpoles(4, 2) as envs, pytest.raises(PolicyError, match="`prefetch` must be a non-negative integer"):
        PolicyRunner(envs, linear_policy(4, 2, seed=0), prefetch=prefetch)


def test_a_prefetching_runner_made_directly_needs_prefetch_of_one_or_more():
    from clusterenv.learner.prefetched_rollouts import PrefetchingRunner

    with cartpoles(4, 2) as envs, pytest.raises(PolicyError, match="`prefetch` must be at least 1, got 0"):
        PrefetchingRunner(envs, linear_policy(4, 2, seed=0), prefetch=0)
