"""Recycling: a worker whose process leaks, or has stepped enough, gets a fresh process between steps.

Its envs are rebuilt from their factories and the step reports their cut episodes as a restart
does (truncated, ``infos["worker_restarted"]``); the other workers' envs are not touched.
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

from clusterenv import ClusterEnv, ExternalLauncher, PolicyRunner, Recycle
from tests.conftest import assert_same
from tests.envs import LeakyCartPole

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="memory is read from /proc")

LEAKY = functools.partial(LeakyCartPole, 4.0)  # 8 MB per batch step for a worker of two
TIGHT = functools.partial(LeakyCartPole, 0.0)


def pids(envs) -> list[int]:
    return [w["pid"] for w in sorted(envs.worker_info, key=lambda w: w["worker_id"])]


def test_a_leaking_worker_is_recycled_by_memory_and_only_its_envs_report_the_cut():
    """Worker 0 leaks 8 MB a step; a fresh worker holds ~50 MB, so a 150 MB bound recycles it every ~12 steps."""
    fns = [LEAKY, LEAKY, TIGHT, TIGHT]
    reference = gym.vector.SyncVectorEnv([TIGHT, TIGHT])  # what worker 1's envs must give, untouched
    recycle = Recycle(rss_mb=150, check_every_s=0.01)
    with ClusterEnv(fns, num_workers=2, recycle=recycle) as envs:
        obs, _ = envs.reset(seed=[0, 1, 2, 3])
        ref_obs, _ = reference.reset(seed=[2, 3])
        assert_same(obs[2:], ref_obs)
        started = pids(envs)
        seen, cuts, rng = {started[0]}, 0, np.random.default_rng(0)
        for _ in range(60):
            actions = rng.integers(0, 2, 4)
            obs, rewards, terminated, truncated, infos = envs.step(actions)
            ref = reference.step(actions[2:])
            assert_same((obs[2:], rewards[2:], terminated[2:], truncated[2:]), ref[:4])
            restarted = infos.get("_worker_restarted", np.zeros(4, bool))
            assert not restarted[2:].any()
            if restarted[:2].any():
                assert restarted[:2].all() and truncated[:2].all() and not terminated[:2].any()
                assert (rewards[:2] == 0).all()
                cuts += 1
            now = pids(envs)
            assert now[1] == started[1]
            seen.add(now[0])
            assert envs.worker_info[0]["rss_mb"] < 150 + 8 * 5  # replaced within a few steps of the bound
        assert cuts >= 2 and cuts == len(seen) - 1  # every replacement reported once, on the step it happened


def test_after_env_steps_each_worker_is_recycled_and_never_two_in_one_step():
    """Four single-env workers all reach 10 env steps together; one is replaced per step, in turn."""
    with ClusterEnv([TIGHT] * 4, num_workers=4, recycle=Recycle(after_env_steps=10)) as envs:
        envs.reset(seed=0)
        before, recycled = pids(envs), []
        for _ in range(40):
            *_, infos = envs.step(np.zeros(4, np.int64))
            now = pids(envs)
            changed = [w for w in range(4) if now[w] != before[w]]
            assert len(changed) <= 1
            flagged = np.flatnonzero(infos.get("_worker_restarted", np.zeros(4, bool))).tolist()
            assert flagged == changed
            recycled += changed
            before = now
        assert sorted(set(recycled)) == [0, 1, 2, 3]


def test_first_ready_batches_recycle_a_worker_whose_envs_the_caller_holds():
    with ClusterEnv([TIGHT] * 4, num_workers=2, batch_size=2, recycle=Recycle(after_env_steps=20)) as envs:
        envs.async_reset(seed=0)
        recycled = 0
        for _ in range(60):
            obs, rewards, terminated, truncated, infos, env_ids = envs.recv()
            restarted = infos.get("_worker_restarted", np.zeros(len(env_ids), bool))
            if restarted.any():
                assert restarted.all() and truncated.all()
                recycled += 1
            envs.send(np.zeros(len(env_ids), np.int64), env_ids)
        envs.recv()
        envs.recv()
        assert recycled >= 2


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Recycle(), ValueError, "after_env_steps` or `rss_mb"),
        (lambda: Recycle(after_env_steps=0), ValueError, "at least 1"),
        (lambda: Recycle(rss_mb=-5), ValueError, "positive number of MB"),
        (lambda: Recycle(rss_mb=100, check_every_s=0), ValueError, "check_every_s"),
    ],
)
def test_a_recycling_policy_that_cannot_work_is_refused(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_recycling_needs_workers_the_learner_starts_and_a_policy():
    with pytest.raises(TypeError, match="clusterenv.Recycle"):
        ClusterEnv([TIGHT] * 2, num_workers=2, recycle={"rss_mb": 100})
    with pytest.raises(ValueError, match="launcher='local'"):
        ClusterEnv(
            [TIGHT] * 2,
            num_workers=2,
            launcher=ExternalLauncher(),
            secret="s" * 32,
            recycle=Recycle(after_env_steps=100),
        )


def test_a_recycled_worker_gets_the_local_policy_back():
    """Recycling replaces a process as a restart does: its restart hooks run, so a PolicyRunner's policy is there."""
    with ClusterEnv(
        [functools.partial(gym.make, "CartPole-v1")] * 4, num_workers=2, recycle=Recycle(after_env_steps=4)
    ) as envs:
        runner = PolicyRunner(envs, torch.nn.Linear(4, 2), seed=0)
        before = {info["worker_id"]: info["pid"] for info in envs.worker_info}
        envs.reset(seed=0)
        for _ in range(6):  # each worker steps 2 envs: both are recycled within these steps
            envs.step(np.zeros(4, np.int64))
        after = {info["worker_id"]: info["pid"] for info in envs.worker_info}
        assert all(after[w] != before[w] for w in before), "both workers were recycled"
        batch = runner.rollout(8)
        assert batch.obs.shape == (8, 4, 4) and (batch.policy_versions == 0).all()
