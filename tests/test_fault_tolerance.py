"""Lost workers are detected by exit status or heartbeats, and with ``restart`` they are replaced."""

from __future__ import annotations

import functools
import os
import signal
import time
from contextlib import closing

import gymnasium as gym
import numpy as np
import pytest
import torch.nn as nn
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from clusterenv import ClusterEnv, PolicyRunner, WorkerLostError
from clusterenv.wire.liveness import Heartbeat
from tests.conftest import assert_same, child_pids, pid_alive, wait_until

FAST = Heartbeat(interval=0.1, liveness=10)  # a silent worker is lost after 1 s
ENV_FNS = [functools.partial(gym.make, "CartPole-v1")] * 4
# Alternating pushes keep CartPole balanced for well over 20 steps, so no episode ends by itself.
ACTIONS = [np.array([t % 2] * 4) for t in range(40)]


def worker_pid(envs: ClusterEnv, worker_id: int) -> int:
    return envs.worker_info[worker_id]["pid"]


def interrupt(pid: int, sig: signal.Signals) -> None:
    os.kill(pid, sig)
    if sig is signal.SIGKILL:
        assert wait_until(lambda: not pid_alive(pid), timeout=5)


@pytest.mark.parametrize("mode", list(AutoresetMode), ids=lambda m: m.value)
def test_sigkilled_worker_is_replaced_and_its_episodes_report_truncated(mode):
    with (
        ClusterEnv(ENV_FNS, num_workers=2, autoreset_mode=mode, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(ENV_FNS, autoreset_mode=mode)) as reference,
    ):
        assert_same(envs.reset(seed=7)[0], reference.reset(seed=7)[0])
        for t in range(5):
            obs, *_ = envs.step(ACTIONS[t])
            reference.step(ACTIONS[t])
        last_obs = obs[2:].copy()
        old_pid = worker_pid(envs, 1)
        interrupt(old_pid, signal.SIGKILL)

        obs, rewards, terminations, truncations, infos = envs.step(ACTIONS[5])
        ref_obs, ref_rewards, ref_terminations, ref_truncations, _ = reference.step(ACTIONS[5])

        # Worker 0's envs: exactly what they would have returned anyway.
        assert_same(obs[:2], ref_obs[:2])
        assert_same(rewards[:2], ref_rewards[:2])
        assert_same(terminations[:2], ref_terminations[:2])
        assert_same(truncations[:2], ref_truncations[:2])
        # Worker 1's envs: the interrupted episode ends as a truncation, flagged.
        assert rewards[2:].tolist() == [0.0, 0.0]
        assert terminations[2:].tolist() == [False, False]
        assert truncations[2:].tolist() == [True, True]
        assert infos["worker_restarted"].tolist() == [False, False, True, True]
        assert infos["_worker_restarted"].tolist() == [False, False, True, True]
        if mode is AutoresetMode.SAME_STEP:
            assert_same(list(infos["final_obs"][2:]), list(last_obs))
            assert not np.array_equal(obs[2:], last_obs)  # already the first observation of a new episode
        else:
            assert_same(obs[2:], last_obs)
        assert worker_pid(envs, 1) != old_pid and not pid_alive(old_pid)

        if mode is AutoresetMode.DISABLED:
            obs, _ = envs.reset(options={"reset_mask": np.array([False, False, True, True])})
            assert_same(obs[:2], ref_obs[:2])
        obs, rewards, terminations, truncations, infos = envs.step(ACTIONS[6])
        ref_obs, ref_rewards, *_ = reference.step(ACTIONS[6])
        assert_same(obs[:2], ref_obs[:2])
        assert "worker_restarted" not in infos
        if mode is AutoresetMode.NEXT_STEP:
            assert rewards[2:].tolist() == [0.0, 0.0]  # the autoreset step that follows any truncation
        else:
            assert rewards[2:].tolist() == [1.0, 1.0]
        assert not (terminations[2:].any() or truncations[2:].any())
        assert envs.single_observation_space.contains(obs[2])

        for t in range(7, 12):  # training continues, worker 0's stream untouched
            obs, rewards, *_ = envs.step(ACTIONS[t])
            ref_obs, ref_rewards, *_ = reference.step(ACTIONS[t])
            assert_same(obs[:2], ref_obs[:2])
            assert rewards[2:].tolist() == [1.0, 1.0]


def test_seeded_reset_is_replayed_on_the_replacement():
    with (
        ClusterEnv(ENV_FNS, num_workers=2, on_worker_failure="restart", heartbeat=FAST) as envs,
        closing(SyncVectorEnv(ENV_FNS)) as reference,
    ):
        envs.reset(seed=1)
        interrupt(worker_pid(envs, 0), signal.SIGKILL)
        assert_same(envs.reset(seed=2), reference.reset(seed=2))


def test_stopped_worker_is_lost_within_the_heartbeat_window():
    # Local workers have an exit status, but a SIGSTOPped one never exits: only heartbeats find it.
    with ClusterEnv(ENV_FNS, num_workers=2, heartbeat=FAST, timeout=60) as envs:
        envs.reset(seed=0)
        pid = worker_pid(envs, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(WorkerLostError, match=r"running envs 2\.\.3, stopped answering heartbeats"):
                envs.step(ACTIONS[0])
            elapsed = time.monotonic() - start
        finally:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert elapsed < FAST.expiry + 5.0, f"detected after {elapsed:.1f} s"
        assert envs.closed


def test_busy_learner_does_not_lose_workers():
    # The learner's heartbeat thread answers while the main thread is elsewhere (a long gradient step).
    with ClusterEnv(ENV_FNS, num_workers=2, heartbeat=FAST) as envs:
        envs.reset(seed=0)
        time.sleep(3 * FAST.expiry)
        assert len(envs.step(ACTIONS[0])) == 5


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_repeated_failures_leak_no_processes_or_descriptors():
    with ClusterEnv(ENV_FNS, num_workers=2, on_worker_failure="restart", heartbeat=FAST) as envs:
        envs.reset(seed=0)

        def fail_and_recover(worker_id: int, sig: signal.Signals) -> None:
            pid = worker_pid(envs, worker_id)
            interrupt(pid, sig)
            _, _, _, truncations, infos = envs.step(ACTIONS[0])
            assert infos["worker_restarted"].tolist() == [w == worker_id for w in (0, 0, 1, 1)]
            assert truncations[2 * worker_id : 2 * worker_id + 2].all()
            assert wait_until(lambda: not pid_alive(pid), timeout=5)

        fail_and_recover(0, signal.SIGKILL)  # first restart warms up whatever is allocated lazily
        fds, children = fd_count(), child_pids()
        for i in range(6):
            fail_and_recover(i % 2, signal.SIGSTOP if i % 3 == 2 else signal.SIGKILL)
        assert len(child_pids()) == len(children) == 2
        assert wait_until(lambda: fd_count() <= fds, timeout=5), f"{fd_count()} descriptors open, {fds} before"


def _exit_while_building() -> gym.Env:
    os._exit(3)


def test_a_worker_that_dies_building_its_envs_is_not_restarted_in_a_loop(caplog):
    # A crash in an env constructor would recur in any replacement: report it, do not replace.
    with pytest.raises(WorkerLostError, match=r"envs 0\.\.0, exited with code 3 while building envs\.$"):
        ClusterEnv([_exit_while_building, ENV_FNS[0]], num_workers=2, on_worker_failure="restart")
    assert "replacing it" not in caplog.text


class ExitsOnArrival(nn.Module):
    """A policy whose unpickling in a worker ends the worker: it dies installing it (the learner copies it safely)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)

    def __setstate__(self, state):
        if os.getpid() != int(os.environ["EXITS_ON_ARRIVAL_SPARES"]):
            os._exit(3)
        super().__setstate__(state)


def test_a_worker_lost_while_installing_a_policy_is_not_replaced(monkeypatch):
    # Installing a policy is declared unrecoverable: the replacement would die the same way.
    monkeypatch.setenv("EXITS_ON_ARRIVAL_SPARES", str(os.getpid()))
    envs = ClusterEnv(ENV_FNS, num_workers=2, on_worker_failure="restart")
    with closing(envs), pytest.raises(WorkerLostError, match="SET_POLICY cannot be recovered on a replacement worker"):
        PolicyRunner(envs, ExitsOnArrival(), seed=0)
