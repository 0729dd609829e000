"""Recovery as a plan: losses during a gather, during recovery itself, and during a prefetched rollout.

The pool collects every reply it can, then recovers each lost worker in turn within the same
receive loop. These tests lose more than one worker at a time, or lose the replacement (or
the survivor taking the envs) while recovery is under way: what was recovered is exact, what
was cut is flagged, and what cannot be recovered raises with every process ended.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from contextlib import closing
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

from clusterenv import ClusterEnv, PolicyRunner, WorkerLostError
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import assert_same, child_pids, pid_alive, wait_until
from tests.envs import SlowCartPole
from tests.policies import linear_policy

FAST = Heartbeat(interval=0.1, liveness=10)  # a silent worker is lost after 1 s
CARTPOLE = functools.partial(gym.make, "CartPole-v1")
# Alternating pushes keep CartPole balanced for well over 20 steps, so no episode ends by itself.
ACTIONS = [np.array([t % 2] * 8) for t in range(40)]


def worker_pid(envs: ClusterEnv, worker_id: int) -> int:
    return next(info["pid"] for info in envs.worker_info if info["worker_id"] == worker_id)


def slow_to_build(marker: str) -> gym.Env:
    """A CartPole whose factory takes 1.5 s once ``marker`` exists: rebuilding it leaves time to kill its host."""
    if os.path.exists(marker):
        time.sleep(1.5)
    return gym.make("CartPole-v1")


class Killer(threading.Thread):
    """Kills each new child of this process (a replacement worker) as soon as it appears, until stopped."""

    def __init__(self, known: set[int]) -> None:
        super().__init__(daemon=True)
        self.known, self.killed, self.stop = set(known), [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in child_pids() - self.known:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
                self.known.add(pid)
            time.sleep(0.002)


def test_two_workers_lost_in_the_same_gather_are_both_replaced_and_the_others_stay_exact():
    with (
        ClusterEnv([CARTPOLE] * 8, num_workers=4, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv([CARTPOLE] * 8)) as reference,
    ):
        assert_same(envs.reset(seed=5)[0], reference.reset(seed=5)[0])
        for t in range(3):
            obs, *_ = envs.step(ACTIONS[t])
            reference.step(ACTIONS[t])
        last_obs = obs.copy()
        lost = [worker_pid(envs, 1), worker_pid(envs, 2)]
        for pid in lost:
            os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not any(pid_alive(pid) for pid in lost), timeout=5)

        obs, rewards, terminations, truncations, infos = envs.step(ACTIONS[3])
        ref_obs, ref_rewards, ref_terminations, ref_truncations, _ = reference.step(ACTIONS[3])
        cut = np.isin(np.arange(8), [2, 3, 4, 5])  # the envs of workers 1 and 2
        for got, want in zip(
            (obs, rewards, terminations, truncations),
            (ref_obs, ref_rewards, ref_terminations, ref_truncations),
            strict=True,
        ):
            assert_same(got[~cut], want[~cut])
        assert (
            infos["worker_restarted"].tolist() == cut.tolist() and infos["_worker_restarted"].tolist() == cut.tolist()
        )
        assert truncations[cut].all() and (rewards[cut] == 0).all() and not terminations[cut].any()
        assert_same(obs[cut], last_obs[cut])  # NEXT_STEP: the last observation; the next step resets
        assert {worker_pid(envs, 1), worker_pid(envs, 2)}.isdisjoint(lost)

        for t in range(4, 8):  # training goes on; the untouched envs stay exact
            obs, rewards, *_ = envs.step(ACTIONS[t])
            ref_obs, ref_rewards, *_ = reference.step(ACTIONS[t])
            assert_same(obs[~cut], ref_obs[~cut])
            assert_same(rewards[~cut], ref_rewards[~cut])


def test_a_replacement_killed_while_it_joins_raises_and_leaves_nothing():
    before = child_pids()
    envs = ClusterEnv([CARTPOLE] * 4, num_workers=2, on_worker_failure="restart", heartbeat=FAST)
    killer = Killer(child_pids())
    try:
        envs.reset(seed=0)
        envs.step(ACTIONS[0][:4])
        killer.start()
        os.kill(worker_pid(envs, 1), signal.SIGKILL)
        with pytest.raises(WorkerLostError, match=r"envs 2\.\.3.* Its replacement was lost too; restarts do not loop"):
            envs.step(ACTIONS[1][:4])
        assert killer.killed, "a replacement was started, and killed before it joined"
        assert envs.closed
    finally:
        killer.stop.set()
        killer.join()
        envs.close(terminate=True)
    assert wait_until(lambda: not (child_pids() - before), timeout=10)


def test_a_survivor_killed_while_it_takes_a_lost_workers_envs_raises_and_leaves_nothing(tmp_path):
    marker = tmp_path / "rebuilding"
    before = child_pids()
    envs = ClusterEnv(
        [functools.partial(slow_to_build, str(marker))] * 6, num_workers=3, on_worker_failure="rehome", heartbeat=FAST
    )
    try:
        envs.reset(seed=0)
        envs.step(ACTIONS[0][:6])
        Path(marker).touch()  # from now on, building the envs takes 3 s per worker
        survivor = worker_pid(envs, 0)  # the least loaded survivor, lowest id first, takes worker 2's envs
        os.kill(worker_pid(envs, 2), signal.SIGKILL)
        threading.Timer(1.0, os.kill, (survivor, signal.SIGKILL)).start()
        with pytest.raises(WorkerLostError, match=r"serving worker 2\), running envs 4\.\.5, exited with code -9"):
            envs.step(ACTIONS[1][:6])
        assert envs.closed
    finally:
        envs.close(terminate=True)
    assert wait_until(lambda: not (child_pids() - before), timeout=10)


def test_two_workers_lost_during_a_prefetched_rollout_are_replaced_and_flagged_once():
    envs = ClusterEnv([lambda: SlowCartPole(0.01)] * 6, num_workers=3, on_worker_failure="restart", heartbeat=FAST)
    try:
        runner = PolicyRunner(envs, linear_policy(4, 2, seed=0), seed=0, prefetch=1)
        runner.rollout(10)
        for w in (0, 2):
            os.kill(worker_pid(envs, w), signal.SIGKILL)
        batches = [runner.rollout(10) for _ in range(4)]
        flags = np.zeros(6, bool)
        for batch in batches:
            for info in batch.infos:
                if "worker_restarted" in info:
                    assert not (flags & info["_worker_restarted"]).any(), "a cut is reported once"
                    flags |= info["_worker_restarted"]
        assert flags.tolist() == [True, True, False, False, True, True]
        assert all(b.num_envs == 6 and b.obs.shape == (10, 6, 4) for b in batches)
        runner.stop()
    finally:
        envs.close()
